"""One job over several hosts: which ranks a node runs, and how its launchers watch each other.

A job of W ranks on N nodes runs one meridian-run per node (``--nodes N --node-rank i
--node-addr A --rendezvous DIR``). Node i runs the contiguous block of ranks
[i*W/N, (i+1)*W/N) (protocol.layout's rule, as for devices), so a host holds whole devices of
a splice and its ranks are neighbours in the reduction order. Node 0 leads: it hosts the job's
TCP store (runtime/rendezvous.py) that every rank's inner gloo group rendezvouses on.

The virtual group is the same on one host and on many: every element of an all-reduce is
combined in logical rank order 0, 1, ..., W-1 (runtime/vpg.py), so the bits do not depend on
how ranks map to hosts. Ranks all on one host reduce through shared memory; when the job spans
hosts, the shared area cannot be mapped by every rank (each host has its own /dev/shm) and the
group takes the gloo path, a rank-order reduce-scatter and all-gather over TCP between the
hosts' addresses. (A hierarchical variant, ranks of a host combining through shared memory
before hosts exchange, can keep the same bits only as a chain in host order, since
floating-point addition is not associative; it is not built: see docs/design/runtime.md.)

`JobPeers` is how the launchers of one job learn of each other's end, through keys in the
leader's store: a node whose job failed sets `failed/<node>`, one whose ranks all finished
sets `finished/<node>`. Every launcher looks every ~0.5 s and ends its own ranks when another
node failed (they would otherwise wait in a collective until gloo's timeout); the leader keeps
its store up until every node has finished or failed.
"""
import time

from protocol.layout import layout_check

PEER_CHECK_S = 0.5
FINISH_WAIT_S = 120.0


def node_ranks(*, world_size: int, nodes: int, node_rank: int) -> range:
    """Returns the ranks node `node_rank` of `nodes` runs: a contiguous block of W/N.
    Raises ValueError (protocol.layout.LayoutError) when nodes does not divide W."""
    layout_check(world_size, nodes)
    if not 0 <= node_rank < nodes:
        raise ValueError(f"--node-rank {node_rank} is not in 0..{nodes - 1}")
    per_node = world_size // nodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


class JobPeers:
    """This node's view of the job's other nodes, through the leader's store (see the docstring)."""

    def __init__(self, store, *, nonce, nodes, node_rank):
        self.store = store
        self.prefix = f"meridian/{nonce}/nodes"
        self.nodes = nodes
        self.node_rank = node_rank
        self._checked_at = 0.0

    def _key(self, what, node):
        return f"{self.prefix}/{what}/{node}"

    def report_failed(self, error: str) -> None:
        try:
            self.store.set(self._key("failed", self.node_rank), error[:2000])
        except (RuntimeError, OSError):
            pass  # the leader is gone: nobody is left to tell

    def report_finished(self) -> None:
        self.store.set(self._key("finished", self.node_rank), "1")

    def failure_elsewhere(self) -> str | None:
        """Returns "node k: error" for the first other node that failed, or None."""
        for node in range(self.nodes):
            if node != self.node_rank and self.store.check([self._key("failed", node)]):
                return f"node {node}: {self.store.get(self._key('failed', node)).decode()}"
        return None

    def check(self) -> str | None:
        """Called from the launcher's loop; at most every PEER_CHECK_S asks the store. Returns
        why the job cannot go on here (another node failed, the leader is unreachable), or None."""
        now = time.monotonic()
        if now - self._checked_at < PEER_CHECK_S:
            return None
        self._checked_at = now
        try:
            return self.failure_elsewhere()
        except (RuntimeError, OSError) as exc:
            return f"the job's leader store is unreachable ({exc})"

    def await_all_finished(self, timeout_s=FINISH_WAIT_S) -> str | None:
        """Leader: waits until every node has finished or failed; returns a failure or None."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            failure = self.failure_elsewhere()
            if failure:
                return failure
            if all(self.store.check([self._key("finished", node)]) for node in range(self.nodes)):
                return None
            time.sleep(0.05)
        return f"not every node finished within {timeout_s:.0f} s"


def join_job(launcher, rendezvous_root):
    """Starts (node 0) or joins (the others) the job's rendezvous; returns (store, master
    address, master port, JobPeers). A follower takes the leader's nonce, so every rank of
    the job uses one key prefix."""
    from protocol.rendezvous import LeaderAddress
    from runtime import rendezvous
    from runtime.exits import LaunchError
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
    peers = JobPeers(store, nonce=launcher.nonce, nodes=launcher.nodes, node_rank=launcher.node_rank)
    return store, addr, port, peers


def finish_node(peers: JobPeers) -> None:
    """This node's ranks all finished: says so; the leader then waits for every other node,
    whose ranks still rendezvous on its store, and fails the job if one failed."""
    from runtime.exits import LaunchError
    peers.report_finished()
    if peers.node_rank == 0:
        failure = peers.await_all_finished()
        if failure:
            raise LaunchError(f"the job failed on another host ({failure})")
