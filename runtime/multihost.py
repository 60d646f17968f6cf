"""One job over several hosts: which ranks a node runs, and how its launchers watch each other.

A job of W ranks on N nodes runs one meridian-run per node (``--nodes N --node-rank i
--node-addr A --rendezvous DIR``). Node i runs one contiguous block of ranks: the one the
control plane gave it (``--first-rank F --host-ranks R``: W/d ranks per device it holds, so
hosts holding 2 + 1 devices run blocks of 2:1 ranks; `host_block`), else the equal block
[i*W/N, (i+1)*W/N) (`node_ranks`). Either way a host holds whole devices of a splice and its
ranks are neighbours in the reduction order; the blocks follow node order (node 0's first).
Each node checks its own block when it starts; each publishes it in the leader's store when it
joins, and the leader checks that they tile 0..W-1 once every node has joined (`blocks_problem`:
a rank run twice or never fails the job by name). Node 0 leads: it hosts the job's TCP store
(runtime/rendezvous.py) that every rank's inner gloo group rendezvouses on.

The virtual group is the same on one host and on many: every element of an all-reduce is
combined in logical rank order 0, 1, ..., W-1 (runtime/vpg.py), so the bits do not depend on
how ranks map to hosts. Ranks all on one host reduce through shared memory; when the job spans
hosts in equal blocks, each host's block of ranks reduces through its own host's shared area and
the hosts chain their partial sums in host order (runtime/hostchain.py): since a host's ranks are
a contiguous block, host order is rank order, and the chain keeps the one-host bits although
floating-point addition is not associative. Unequal blocks, one rank per host or no usable
/dev/shm take the flat gloo path, a rank-order reduce-scatter and all-gather over TCP between the
hosts' addresses: the same bits.

A consistent cut across hosts (framework engine): the leader hands the CutRequest out through
its store in two phases before any rank can see it: every follower must say it received the
request within HAND_OUT_S, else the cut is withdrawn (a frozen, partitioned or lost host: the
cut fails cleanly, no rank ever saw it, the job goes on); then "go": each node writes it to its
own spool, where its ranks find it at the next step boundary and agree on the step through the
meta-allreduce that spans all ranks of all hosts (runtime/cut.py), so every rank on every host
stops after the same step. Each follower reports its ranks' result to the leader
(NodeCutReport); the leader commits the one checkpoint of the job (every rank's state, written
into one staging folder of the shared store) only when every node reported its ranks saved at
that step: a checkpoint that misses one host's part is never committed. A host that stalls after
"go" stalls every rank (collectives span hosts): the leader's deadline then ends the cut as
failed and the job goes on once the host is back (its ranks then save into a staging folder
that is never committed: the store ignores uncommitted staging folders).

The same cut with the CRIU engine (runtime/criu_parts.py): the ranks park with no socket open;
each follower dumps its own ranks (left running, still parked) into its part of the staging
folder and reports the part manifest's sha256 with its NodeCutReport; the leader dumps its part,
verifies every part and commits. The leader's `cut/<id>/outcome` tells the followers what their
parked ranks do: a checkpoint's go on as soon as every part is dumped ("dumped", before the
check and the commit: downtime is the dumps only); a stop's end once it is committed
("committed"). A part missing or bad: the leader withdraws the cut instead (`cut/<id>/withdrawn`,
also after "go": Launcher.abandon_cut), nothing is committed and every host's ranks go on,
after a checkpoint and after a stop alike.

`JobPeers` is how the launchers of one job learn of each other's end, through keys in the
leader's store: a node whose job failed sets `failed/<node>`, one whose ranks all finished
sets `finished/<node>`. Every launcher looks every ~0.5 s and ends its own ranks when another
node failed (they would otherwise wait in a collective until gloo's timeout); the leader keeps
its store up until every node has finished or failed. Each launcher also beats (`alive/<node>`)
at every look; while a follower's main thread is busy in one long call (its CRIU dump) a thread
beats for it (JobPeers.beating), so that the leader may take silence for a lost host throughout,
inside a cut as well.
"""
import contextlib
import datetime
import json
import threading
import time

from protocol.cut import CutRequest
from protocol.layout import layout_check
from protocol.rendezvous import NodeCutReport
from runtime.exits import EXIT_USAGE, LaunchError
from runtime.store import CheckpointError

PEER_CHECK_S = 0.5
LOST_AFTER_S = 30.0  # a node whose heartbeat has not moved this long is lost (killed, frozen, cut off)
FINISH_WAIT_S = 120.0
# How long the leader of a resume waits for every other host to check its part of the checkpoint
# (runtime/criu_parts.py: each host hashes what it restores) before it restores anything itself.
RESUME_CHECK_S = 900.0
HAND_OUT_S = 10.0  # how long every follower has to take a cut request before the cut is off
FOLLOW_CHECK_S = 0.05
OUTCOME_DUMPED = "dumped"  # every host's part is dumped: a checkpoint's ranks go on
OUTCOME_COMMITTED = "committed"  # the checkpoint is committed: a stop's ranks end


def node_ranks(*, world_size: int, nodes: int, node_rank: int) -> range:
    """Returns the ranks node `node_rank` of `nodes` runs when the hosts hold equal shares: a
    contiguous block of W/N (what a launch without --first-rank/--host-ranks runs, and how a
    checkpoint that names no blocks was dumped). Raises ValueError (protocol.layout.LayoutError)
    when nodes does not divide W."""
    layout_check(world_size, nodes)
    if not 0 <= node_rank < nodes:
        raise ValueError(f"--node-rank {node_rank} is not in 0..{nodes - 1}")
    per_node = world_size // nodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def host_block(*, world_size: int, nodes: int, node_rank: int, first_rank: int | None = None,
               ranks: int | None = None) -> range:
    """Returns the contiguous block of ranks node `node_rank` of `nodes` runs: [first_rank,
    first_rank + ranks) when given (the control plane's share: W/d ranks per device of this host,
    so hosts holding unequal device counts run unequal blocks), else the equal W/N block
    (node_ranks). Raises ValueError naming what is wrong: only one of the two given, a block
    outside 0..W-1 or empty, node 0's block not starting at rank 0 or the last node's not ending
    at W-1 (host order is rank order: the leader's ranks come first), a block that leaves no rank
    for the other hosts, or one host holding less than all ranks."""
    if first_rank is None and ranks is None:
        return node_ranks(world_size=world_size, nodes=nodes, node_rank=node_rank)
    if first_rank is None or ranks is None:
        raise ValueError("--first-rank and --host-ranks go together (this host's block of ranks)")
    if not 0 <= node_rank < nodes:
        raise ValueError(f"--node-rank {node_rank} is not in 0..{nodes - 1}")
    block = range(first_rank, first_rank + ranks)
    where = f"ranks {block.start}..{block.stop - 1}" if ranks >= 1 else f"{ranks} ranks from {first_rank}"
    if ranks < 1 or first_rank < 0 or block.stop > world_size:
        raise ValueError(f"this host's block ({where}) is not inside the job's ranks 0..{world_size - 1}")
    if node_rank == 0 and block.start != 0:
        raise ValueError(f"node 0 leads and runs the first block of ranks, from rank 0; it was given {where}")
    if node_rank == nodes - 1 and block.stop != world_size:
        raise ValueError(f"node {node_rank} is the last of {nodes} and runs the last block of ranks, up to "
                         f"rank {world_size - 1}; it was given {where}")
    before, after = node_rank, nodes - 1 - node_rank  # hosts that need at least one rank each
    if block.start < before or world_size - block.stop < after:
        raise ValueError(f"node {node_rank} of {nodes} was given {where}, which leaves fewer ranks than hosts "
                         f"before or after it (each host runs at least one)")
    return block


def blocks_problem(blocks: dict[int, range], *, world_size: int, nodes: int) -> str | None:
    """Returns why the hosts' blocks of ranks `blocks` ({node: its block}, every node's) cannot run
    the job, or None: they must tile 0..W-1 in node order, each starting where the one before ends
    (a rank run twice or never would hang the job's group, or mix two ranks' state)."""
    expected = 0
    for node in range(nodes):
        block = blocks[node]
        if block.start != expected:
            said = ", ".join(f"node {n}: {b.start}..{b.stop - 1}" for n, b in sorted(blocks.items()))
            what = "overlaps the one before" if block.start < expected else "leaves a gap after the one before"
            return (f"the hosts' blocks of ranks do not cover 0..{world_size - 1} once each in host order "
                    f"(node {node}'s {what}: {said})")
        expected = block.stop
    if expected != world_size:
        return f"the hosts' blocks of ranks end at rank {expected - 1}, not at {world_size - 1}"
    return None


class JobPeers:
    """This node's view of the job's other nodes, through the leader's store (see the docstring)."""

    def __init__(self, store, *, nonce, nodes, node_rank, world_size=None):
        self.store = store
        self.nonce = nonce
        self.prefix = f"meridian/{nonce}/nodes"
        self.nodes = nodes
        self.node_rank = node_rank
        # The leader checks once that the blocks of ranks every node published tile 0..W-1
        # (blocks_problem); None: not asked to (a JobPeers made without the job's world size).
        self.world_size = world_size
        self._blocks_checked = world_size is None
        self._checked_at = 0.0
        self._beats = 0
        self._heard = {}  # leader: node -> (last heartbeat value, monotonic time it changed)
        # Whether the failure check() returned last is a host failing under the job (fenced, silent,
        # the leader unreachable) rather than its code: the launcher restarts it, not fails it.
        self.host_failed = False

    def _key(self, what, node):
        return f"{self.prefix}/{what}/{node}"

    def cut_key(self, request_id, what, node=None):
        key = f"meridian/{self.nonce}/cut/{request_id}/{what}"
        return key if node is None else f"{key}/{node}"

    # The leader's store as a follower reads and writes it inside the loop and a cut. Found on emulated
    # hosts (tests/hosts/test_multihost_killed_mid_checkpoint.py): with the leader's host killed, the
    # store's DistNetworkError escaped follow_cut as a traceback, so the follower wrote no Failed
    # event, its agent saw a job that failed by its code, and the job was failed, not restarted.
    def has(self, key) -> bool:
        """Returns whether the leader's store holds `key`. Raises LaunchError (host_failure) when the
        store is unreachable: the leader's host failed under the job (or is cut off)."""
        try:
            return bool(self.store.check([key]))
        except (RuntimeError, OSError) as exc:
            raise self._unreachable(exc) from None

    def get(self, key) -> bytes:
        """Returns the value of `key` in the leader's store; raises LaunchError as has() does."""
        try:
            return self.store.get(key)
        except (RuntimeError, OSError) as exc:
            raise self._unreachable(exc) from None

    def set(self, key, value: str) -> None:
        """Sets `key` in the leader's store; raises LaunchError as has() does."""
        try:
            self.store.set(key, value)
        except (RuntimeError, OSError) as exc:
            raise self._unreachable(exc) from None

    def _unreachable(self, exc) -> LaunchError:
        self.host_failed = True
        return LaunchError(f"the job's leader store is unreachable ({exc}); this node's ranks are ended",
                           host_failure=True)

    def withdraw_cut(self, request_id) -> None:
        """Leader: the cut `request_id` is off; a follower that has not started it never will."""
        try:
            self.store.set(self.cut_key(request_id, "withdrawn"), "1")
        except (RuntimeError, OSError):
            pass

    def report_failed(self, error: str, *, host_failure: bool = False) -> None:
        """Tells the other hosts this one failed; `host_failure`: because its host failed under it
        (fenced), not because of the job's code (see failure_elsewhere)."""
        try:
            if host_failure:
                self.store.set(self._key("host_failure", self.node_rank), "1")
            self.store.set(self._key("failed", self.node_rank), error[:2000])
        except (RuntimeError, OSError):
            pass  # the leader is gone: nobody is left to tell

    def claim_join(self) -> None:
        """Follower: claims this node's one place in the leader's run; raises LaunchError
        (host_failure) when a launch of this node already joined it.

        The chaos soak on emulated hosts found it (job 206, devlog 2026-12-06/lead23.md): an agent
        that self-fenced killed its part of a job, reached the control plane 2 s later and, told
        the same generation still ran there, launched that part again. The new launcher found the
        leader's store (same leader, same nonce) and its ranks joined a group whose other ranks had
        already formed it with the killed ones, under the same keys: DDP's first check read another
        rank's data and the job failed as if by its code. A group cannot take a part back, so the
        second join is refused and told to the other hosts as a host failure: every part ends and
        the control plane restarts the job from its last checkpoint (a new generation, a new group)."""
        joins = self.store.add(self._key("joined", self.node_rank), 1)
        if joins != 1 and self.store.check([self._key("finished", self.node_rank)]):
            # The earlier launch's ranks ran to the end and said so (the 30-minute soak, session 24:
            # its agent was frozen or killed right after): nothing is left to run here, and the
            # leader is not told of a failure, or it would fail a job whose every rank finished.
            raise LaunchError(f"node {self.node_rank}'s part of this run already finished (an earlier launch "
                              "of it on this host); nothing is left to run here: the job's leader reports its end")
        if joins != 1:
            error = (f"node {self.node_rank}'s part of this run already joined its leader once (an earlier "
                     "launch of it on this host ended while the other hosts' parts went on); a part cannot "
                     "rejoin a running group: the job restarts from its last checkpoint")
            self.report_failed(error, host_failure=True)
            raise LaunchError(error, host_failure=True)

    def publish_block(self, block: range) -> None:
        """Tells the other nodes which ranks this node runs (its launch's --first-rank/--host-ranks)."""
        self.set(self._key("block", self.node_rank), f"{block.start},{len(block)}")

    def blocks(self) -> dict[int, range] | None:
        """Returns {node: the block of ranks it published} for every node, or None while one has not
        published yet (it has not joined). A value that is not two whole numbers reads as an empty
        block at -1, which blocks_problem refuses."""
        blocks = {}
        for node in range(self.nodes):
            key = self._key("block", node)
            if not self.store.check([key]):
                return None
            try:
                first, count = (int(part) for part in self.store.get(key).decode().split(","))
            except ValueError:
                first, count = -1, 0
            blocks[node] = range(first, first + count)
        return blocks

    def _layout_problem(self) -> str | None:
        """Leader, from its loop: once every node published its block, whether they tile the job's
        ranks (a host given a block that overlaps another's, or leaves a gap, fails the job by name
        before its group could hang or mix two copies of a rank); later calls return None."""
        if self._blocks_checked:
            return None
        blocks = self.blocks()
        if blocks is None:
            return None
        self._blocks_checked = True
        return blocks_problem(blocks, world_size=self.world_size, nodes=self.nodes)

    def report_finished(self) -> None:
        self.set(self._key("finished", self.node_rank), "1")

    def report_resume_checked(self) -> None:
        """A follower checked its part of the checkpoint the leader resumes from: it may be restored."""
        self.set(self._key("resume_checked", self.node_rank), "1")

    def await_resume_checked(self, timeout_s=RESUME_CHECK_S) -> tuple[str, bool] | None:
        """Leader: waits until every other node checked its part of the checkpoint (or failed),
        then lets them restore (resume_go); returns None, or (why not, whether a host failed
        rather than a part): a node that said its part is bad, or one that said nothing within
        `timeout_s` (killed, frozen: a host failure, the job restarts)."""
        followers = [self._key("resume_checked", node) for node in range(1, self.nodes)]
        problem = self._await(lambda: all(self.store.check([key]) for key in followers), timeout_s,
                              "not every host checked its part of the checkpoint")
        if problem is None:
            self.store.set(self._key("resume_go", 0), "1")
        return problem

    def await_resume_go(self, timeout_s=RESUME_CHECK_S + 60.0) -> tuple[str, bool] | None:
        """Follower: waits until the leader heard every host's check (None) or failed."""
        return self._await(lambda: self.store.check([self._key("resume_go", 0)]), timeout_s,
                           "the leader never said the checkpoint may be restored")

    def _await(self, done, timeout_s, silent) -> tuple[str, bool] | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                failure = self.failure_elsewhere()
                if failure:
                    return failure, self.host_failed
                if done():
                    return None
            except (RuntimeError, OSError) as exc:  # the leader's store, gone with its host
                self.host_failed = True
                return f"the job's leader store is unreachable ({exc})", True
            time.sleep(0.05)
        return f"{silent} within {timeout_s:.0f} s", True

    def failure_elsewhere(self) -> str | None:
        """Returns "node k: error" for the first other node that failed, or None. When that node
        said its host failed under it (report_failed(host_failure=True)), `host_failed` is set."""
        for node in range(self.nodes):
            if node != self.node_rank and self.store.check([self._key("failed", node)]):
                self.host_failed = self.store.check([self._key("host_failure", node)])
                return f"node {node}: {self.store.get(self._key('failed', node)).decode()}"
        return None

    def check(self) -> str | None:
        """Called from the launcher's loop and while it waits inside a cut; at most every
        PEER_CHECK_S asks the store (and beats). Returns why the job cannot go on here (another
        node failed, the leader is unreachable, a follower silent: see lost_node), or None."""
        now = time.monotonic()
        if now - self._checked_at < PEER_CHECK_S:
            return None
        self._checked_at = now
        try:
            self._beat(self.store)
            if self.node_rank == 0 and (problem := self._layout_problem()):
                self.host_failed = False  # the launch's layout is wrong, not a host: restarting it is no cure
                return problem
        except (RuntimeError, OSError) as exc:
            self.host_failed = True
            return f"the job's leader store is unreachable ({exc})"
        return self._failure_now(now)

    def _beat(self, store) -> None:
        self._beats += 1
        store.set(self._key("alive", self.node_rank), str(self._beats))

    @contextlib.contextmanager
    def beating(self):
        """Beats from a thread while the caller's thread is busy in one long call (a follower's CRIU
        dump of its ranks, which may take longer than LOST_AFTER_S): a host killed meanwhile falls
        silent and the leader ends the cut within LOST_AFTER_S, not at the cut's deadline. The
        thread has its own connection to the leader's store (one client is not shared across
        threads); if the store is gone it stops, and the caller's next check() says so. On the
        leader it does nothing: no host judges the leader by its beat (they see its store)."""
        if self.node_rank == 0:
            yield
            return
        stop = threading.Event()

        def beat():
            try:
                import torch.distributed as dist
                store = dist.TCPStore(self.store.host, self.store.port, None, is_master=False,
                                      timeout=datetime.timedelta(seconds=5))
                while not stop.wait(PEER_CHECK_S):
                    self._beat(store)
            except (RuntimeError, OSError):
                return

        thread = threading.Thread(target=beat, name=f"meridian-beat-{self.node_rank}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=10.0)

    def _failure_now(self, now) -> str | None:
        """Another node's failure, a follower lost (leader only) or the leader's store unreachable,
        with `host_failed` set as the cause is a host failing under the job; or None."""
        try:
            failure = self.failure_elsewhere()
            if failure is None and self.node_rank == 0:
                failure = self.lost_node(now)
                self.host_failed = failure is not None
            return failure
        except (RuntimeError, OSError) as exc:  # the leader's store went with its host
            self.host_failed = True
            return f"the job's leader store is unreachable ({exc})"

    def lost_node(self, now) -> str | None:
        """Leader: returns "node k ..." for a follower whose heartbeat stood still LOST_AFTER_S
        (its ranks can no longer take part: the job must restart from its last checkpoint). A
        follower that said its ranks finished stops beating when it exits: it is not lost."""
        for node in range(1, self.nodes):
            if self.store.check([self._key("finished", node)]):
                continue  # its ranks all finished and its launcher left: silent, not lost
            key = self._key("alive", node)
            value = self.store.get(key) if self.store.check([key]) else None
            last, since = self._heard.get(node, (None, now))
            if value != last or node not in self._heard:
                self._heard[node] = (value, now)
            elif now - since > LOST_AFTER_S:
                return (f"node {node} sent no heartbeat for {LOST_AFTER_S:.0f} s (killed, frozen or cut "
                        "off); the job must restart from its last checkpoint")
        return None

    def failure_behind(self, timeout_s=LOST_AFTER_S + 2.0) -> str | None:
        """After one of this host's ranks failed: waits up to `timeout_s` for another host's failure
        that explains it (a host killed under the job makes its peers' collectives fail at once,
        before it is found silent); returns it ("node k: ...", `host_failed` set when a host
        failed under the job), or None: the failure is this host's own."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (failure := self._failure_now(time.monotonic())) is not None:
                return failure
            time.sleep(PEER_CHECK_S)
        return None

    def await_all_finished(self, timeout_s=FINISH_WAIT_S) -> tuple[str, bool] | None:
        """Leader: waits until every node has finished or failed; returns None, or (the failure,
        whether a host failed under the job rather than by its code; a node silent past
        `timeout_s` counts as a host failure)."""
        finished = [self._key("finished", node) for node in range(self.nodes)]
        return self._await(lambda: all(self.store.check([key]) for key in finished), timeout_s,
                           "not every node finished")


def join_job(launcher, rendezvous_root):
    """Starts (node 0) or joins (the others) the job's rendezvous; returns (store, master
    address, master port, JobPeers). A follower takes the leader's nonce, so every rank of
    the job uses one key prefix."""
    from protocol.rendezvous import LeaderAddress
    from runtime import rendezvous
    folder = rendezvous.FolderRendezvous(rendezvous_root, launcher.job_id)
    if launcher.node_rank == 0:
        store = rendezvous.host_leader_store(addr=launcher.node_addr, world_size=launcher.world_size,
                                             nonce=launcher.nonce)
        folder.publish(LeaderAddress(job_id=launcher.job_id, nonce=launcher.nonce,
                                     addr=launcher.node_addr, port=store.port, nodes=launcher.nodes,
                                     world_size=launcher.world_size))
        addr, port = launcher.node_addr, store.port
    else:
        try:
            leader, store = rendezvous.connect_to_leader(
                folder, job_id=launcher.job_id, timeout_s=launcher.options.rendezvous_timeout)
        except rendezvous.RendezvousError as exc:
            raise LaunchError(str(exc)) from None
        if leader.nodes != launcher.nodes or leader.world_size != launcher.world_size:
            raise LaunchError(f"the leader runs {leader.world_size} ranks on {leader.nodes} nodes, "
                              f"this node was given {launcher.world_size} on {launcher.nodes}")
        launcher.nonce = leader.nonce
        addr, port = leader.addr, leader.port
    peers = JobPeers(store, nonce=launcher.nonce, nodes=launcher.nodes, node_rank=launcher.node_rank,
                     world_size=launcher.world_size)
    if launcher.node_rank != 0:
        peers.claim_join()
    peers.publish_block(launcher.local_ranks)
    return store, addr, port, peers


def finish_node(peers: JobPeers) -> None:
    """This node's ranks all finished: says so; the leader then waits for every other node,
    whose ranks still rendezvous on its store, and fails the job if one failed: as a host failure
    (the job restarts from its last checkpoint) when that host failed under the job rather than by
    its code (the 30-minute soak, session 24: a follower's second launch refused by claim_join while
    the leader waited here failed the job for good)."""
    peers.report_finished()
    if peers.node_rank == 0:
        problem = peers.await_all_finished()
        if problem:
            failure, host_failed = problem
            raise LaunchError(f"the job failed on another host ({failure})", host_failure=host_failed)


def refusal(launcher, request) -> str | None:
    """Returns why a control command cannot be carried out on this node of a multi-host job,
    or None (single-host jobs: always None)."""
    from protocol.launch import CheckpointRequest, StopRequest
    if launcher.nodes == 1:
        return None
    if launcher.node_rank != 0:
        return f"{request.cmd}: this is node {launcher.node_rank} of a multi-host job; send it to node 0, the leader"
    if not isinstance(request, (CheckpointRequest, StopRequest)):
        return f"{request.cmd} of a job spanning {launcher.nodes} hosts is not built yet; the job goes on"
    return None


def hand_out_cut(peers: JobPeers, request: CutRequest) -> None:
    """Leader: gives `request` to every follower and returns once all have it; withdraws it and
    raises LaunchError naming the hosts that did not take it within HAND_OUT_S."""
    peers.store.set(peers.cut_key(request.id, "request"), json.dumps(request.to_dict()))
    peers.store.set(f"meridian/{peers.nonce}/cut/latest", str(request.id))
    deadline = time.monotonic() + HAND_OUT_S
    followers = range(1, peers.nodes)
    while True:
        missing = [n for n in followers if not peers.has(peers.cut_key(request.id, "received", n))]
        if not missing:
            break
        if time.monotonic() > deadline:
            peers.withdraw_cut(request.id)
            raise LaunchError(f"{request.action} refused: host(s) of node(s) {missing} did not take the cut "
                              f"request within {HAND_OUT_S:.0f} s (frozen, partitioned or gone); no rank saw "
                              "it and the job goes on")
        time.sleep(0.01)
    peers.store.set(peers.cut_key(request.id, "go"), "1")


def gather_cut_reports(launcher, request: CutRequest, deadline: float) -> set[int]:
    """Leader: waits for every follower's NodeCutReport of `request`; returns the steps they cut
    at. Raises LaunchError (withdrawing the cut) when one fails or the deadline passes."""
    peers = launcher.peers
    steps = set()
    for node in range(1, peers.nodes):
        key = peers.cut_key(request.id, "report", node)
        while not peers.has(key):
            if time.monotonic() > deadline:
                peers.withdraw_cut(request.id)
                launcher.abandon_cut(request.id)
                raise LaunchError(f"{request.action}: node {node} did not report its ranks' cut in time; "
                                  "the job goes on")
            if launcher.check_ranks():
                raise LaunchError(f"the job finished before reaching the cut for {request.action}")
            launcher.check_peers_in_cut(request)
            time.sleep(0.01)
        report = NodeCutReport.from_dict(json.loads(peers.store.get(key)))
        if report.status != "ok" or report.step is None:
            launcher.abandon_cut(request.id)
            raise LaunchError(f"{request.action} refused on node {node}: {report.error}")
        steps.add(report.step)
    return steps


def follow_cut(launcher) -> str | None:
    """Follower: carries out a cut the leader handed out, if there is a new one; returns
    "stopped" when it was a stop and this node's ranks have exited after saving (CRIU: were ended
    once the leader committed the checkpoint holding their part), else None."""
    peers = launcher.peers
    now = time.monotonic()
    if now - getattr(launcher, "_cut_checked_at", 0.0) < FOLLOW_CHECK_S:
        return None
    launcher._cut_checked_at = now
    latest_key = f"meridian/{peers.nonce}/cut/latest"
    if not peers.has(latest_key):
        return None
    request_id = int(peers.get(latest_key))
    if request_id <= launcher.last_request_id:
        return None
    launcher.last_request_id = request_id
    request = CutRequest.from_dict(json.loads(peers.get(peers.cut_key(request_id, "request"))))
    peers.set(peers.cut_key(request_id, "received", peers.node_rank), "1")
    deadline = time.monotonic() + 2 * HAND_OUT_S
    while not peers.has(peers.cut_key(request_id, "go")):
        if peers.has(peers.cut_key(request_id, "withdrawn")) or time.monotonic() > deadline:
            return None  # the cut is off before any rank saw it
        time.sleep(0.005)
    report = NodeCutReport(node=peers.node_rank, request_id=request_id, status="error", error="no report")
    engine = launcher.checkpoints
    parked = False  # this node's ranks wait at the cut for the leader's outcome (dumps_per_host)
    try:
        _, step, _, errors = launcher.await_cut(request, FINISH_WAIT_S * 5)
        parked = engine.dumps_per_host and request.action in ("checkpoint", "stop")
        if errors:
            report = NodeCutReport(node=peers.node_rank, request_id=request_id, status="error", step=step,
                                   error="; ".join(f"rank {k}: {v.problem()}" for k, v in errors.items()))
        elif parked:
            with peers.beating():  # silent for the whole dump, it would be taken for a lost host
                part = engine.dump_part(launcher, request, step)
            report = NodeCutReport(node=peers.node_rank, request_id=request_id, status="ok", step=step,
                                   part_manifest_sha256=part)
        else:
            report = NodeCutReport(node=peers.node_rank, request_id=request_id, status="ok", step=step)
    except LaunchError as exc:
        report = NodeCutReport(node=peers.node_rank, request_id=request_id, status="error", error=str(exc))
    try:
        peers.store.set(peers.cut_key(request_id, "report", peers.node_rank), json.dumps(report.to_dict()))
    except (RuntimeError, OSError):
        return None  # the leader's store is gone with it: the launcher's next peer check ends this node
    if parked:
        outcome = await_outcome(launcher, request_id)
        if outcome == OUTCOME_COMMITTED and request.action == "stop":
            launcher.kill_all()  # dumped into the committed checkpoint: the job goes on from there
            from protocol.launch import Stopped
            launcher.event(Stopped, step=report.step or 0, checkpoint="")
            return "stopped"
        launcher.resume_ranks(request_id)  # a checkpoint's parts dumped, or no checkpoint: the ranks go on
        return None
    if request.action == "stop" and report.status == "ok":
        launcher.wait_all_exit(FINISH_WAIT_S)
        # The leader commits the job's one checkpoint and names it in its own events; this
        # node's agent learns only that its share stopped at the cut.
        from protocol.launch import Stopped
        launcher.event(Stopped, step=report.step or 0, checkpoint="")
        return "stopped"
    return None


def reported_parts(peers: JobPeers, request_id: int) -> dict[int, str | None]:
    """Leader: returns {node: the part manifest sha256 its NodeCutReport of `request_id` named}
    for every follower that reported (gather_cut_reports waited for them all)."""
    parts = {}
    for node in range(1, peers.nodes):
        key = peers.cut_key(request_id, "report", node)
        if peers.has(key):
            parts[node] = NodeCutReport.from_dict(json.loads(peers.store.get(key))).part_manifest_sha256
    return parts


def announce_outcome(peers: JobPeers, request_id: int, outcome: str, timeout_s: float = HAND_OUT_S * 3) -> None:
    """Leader: tells the followers whose ranks wait at cut `request_id` its `outcome`
    (OUTCOME_DUMPED, OUTCOME_COMMITTED). For a commit it waits (at most `timeout_s`) until each
    has read it: after a stop the leader's store, which they read it from, goes away with the
    leader. A follower that does not answer is ended by its own peer check (the leader's store
    unreachable): the checkpoint stands either way."""
    peers.store.set(peers.cut_key(request_id, "outcome"), outcome)
    if outcome != OUTCOME_COMMITTED:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(peers.has(peers.cut_key(request_id, "settled", node)) for node in range(1, peers.nodes)):
            return
        time.sleep(0.01)


def await_outcome(launcher, request_id: int) -> str | None:
    """Follower whose ranks wait at the cut `request_id`: returns the leader's outcome
    (OUTCOME_DUMPED, OUTCOME_COMMITTED), or None when it withdrew the cut (no checkpoint). Raises
    LaunchError when the job cannot go on (another node failed, the leader unreachable) or no
    outcome came in time."""
    peers = launcher.peers
    deadline = time.monotonic() + FINISH_WAIT_S * 5
    while time.monotonic() < deadline:
        if peers.has(peers.cut_key(request_id, "outcome")):
            outcome = peers.get(peers.cut_key(request_id, "outcome")).decode()
            peers.set(peers.cut_key(request_id, "settled", peers.node_rank), "1")
            return outcome
        if peers.has(peers.cut_key(request_id, "withdrawn")):
            return None
        if failure := peers.check():
            raise LaunchError(f"the job failed on another host while this node's ranks waited at a cut "
                              f"({failure}); this node's ranks are ended", host_failure=peers.host_failed)
        time.sleep(0.01)
    raise LaunchError(f"the leader decided nothing about cut {request_id} within {FINISH_WAIT_S * 5:.0f} s; "
                      "this node's ranks are ended")


def agree_on_checkpoint(launcher, ref):
    """--resume on several hosts: the leader's newest good checkpoint is everyone's, and no host
    restores it before every host checked its own part of it (each host checks what it restores:
    runtime/criu_parts.py). Returns the ref to resume from (None: there is none); raises
    LaunchError when this node's store sees another newest checkpoint than the leader's (the
    store is not shared as it must be, or this node's part of it is bad: it says which), and on
    the leader when another host refused its part or never said (nothing is restored then)."""
    peers = launcher.peers
    key = f"meridian/{peers.nonce}/resume-uri"
    if peers.node_rank == 0:
        peers.store.set(key, ref.uri if ref is not None else "")
        problem = peers.await_resume_checked() if ref is not None else None
        if problem is not None:
            why, host_failure = problem
            raise LaunchError(f"--resume refused: {why}; no host restored anything", EXIT_USAGE,
                              host_failure=host_failure)
        return ref
    uri = peers.get(key).decode()
    if not uri:
        return None
    if ref is None or ref.uri != uri:
        theirs = next((found for found in launcher.store.list() if found.uri == uri), None)
        if theirs is not None:
            try:
                launcher.store.verify(theirs)
            except CheckpointError as exc:
                raise LaunchError(f"--resume: node {peers.node_rank} cannot restore its part of {uri}, the "
                                  f"leader's choice: {exc}", EXIT_USAGE) from None
        raise LaunchError(f"--resume: the leader resumes from {uri} but this node's store "
                          f"{launcher.store.root} has {ref.uri if ref else 'no checkpoint'} as its newest; "
                          "every node of the job must use the same shared --store")
    peers.report_resume_checked()
    problem = peers.await_resume_go()
    if problem is not None:
        why, host_failure = problem
        raise LaunchError(f"--resume refused: {why}; no host restored anything", EXIT_USAGE, host_failure=host_failure)
    return ref
