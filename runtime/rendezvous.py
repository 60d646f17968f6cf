"""How the launchers of one multi-host job find their leader: through the shared store.

The leading launcher (node rank 0) hosts the job's TCP store on its own network address with a
port the kernel picks at run time (no fixed ports), sets `<nonce key>` in it, and publishes a
`protocol.rendezvous.LeaderAddress` at ``<rendezvous root>/<job-id>/leader.json`` (one atomic
rename). A follower polls for that file, connects to the address it names and reads the nonce
key back: a file left by an earlier attempt names a store that is gone (the connection fails)
or holds another nonce, and the follower keeps waiting until its deadline.

The rendezvous root is a folder of the shared store (an NFS/Lustre mount here; on emulated hosts
a bind mount, tests/hosts/emulated_hosts.py). Only whole-file create / replace / read is used, which an
object store's put and get give too: `FolderRendezvous` is the one place to swap for one.
"""
import datetime
import os
import pathlib
import time

from protocol import ProtocolError
from protocol.rendezvous import LeaderAddress, NodeAddress
from runtime import spool as spool_files

NONCE_KEY = "meridian/leader-nonce"
POLL_S = 0.05
DEFAULT_TIMEOUT_S = 300.0
STORE_TIMEOUT_S = 60.0  # a follower's store call to a lost leader fails after this


class RendezvousError(RuntimeError):
    pass


class FolderRendezvous:
    """The job's rendezvous folder in the shared store."""

    def __init__(self, root, job_id):
        if not job_id or "/" in job_id or job_id in (".", ".."):
            raise ValueError(f"job id {job_id!r} must be a non-empty name without '/'")
        self.folder = pathlib.Path(root) / job_id
        self.path = self.folder / "leader.json"

    def publish(self, leader: LeaderAddress) -> None:
        spool_files.write_json_atomic(self.path, leader.to_dict())

    def publish_node(self, node: NodeAddress) -> None:
        """Publishes this host's node address (a job spanning hosts with an isolated network)."""
        spool_files.write_json_atomic(self.folder / "nodes" / f"{node.node_rank}.json", node.to_dict())

    def read_nodes(self, *, job_id: str, nodes: int) -> dict[int, str]:
        """Returns {node rank: node address} of the hosts of job `job_id` that published theirs. A
        file that is not a NodeAddress of this job at its own rank is not one (skipped): what the
        folder says is checked before a launcher routes it as root."""
        found = {}
        for node_rank in range(nodes):
            try:
                payload = spool_files.read_json(self.folder / "nodes" / f"{node_rank}.json")
                node = NodeAddress.from_dict(payload) if payload is not None else None
            except (ValueError, ProtocolError):
                continue
            if node is not None and node.job_id == job_id and node.node_rank == node_rank:
                found[node_rank] = node.addr
        return found

    def read(self) -> LeaderAddress | None:
        try:
            payload = spool_files.read_json(self.path)
        except ValueError:  # half a file cannot happen (atomic rename); garbage is "not yet"
            return None
        if payload is None:
            return None
        try:
            return LeaderAddress.from_dict(payload)
        except ProtocolError:
            return None


def host_leader_store(*, addr, world_size, nonce):
    """Returns the leader's TCP store server, on `addr` with a run-time port, its nonce set."""
    import torch.distributed as dist
    store = dist.TCPStore(addr, 0, world_size, is_master=True, wait_for_workers=False)
    store.set(NONCE_KEY, nonce)
    return store


def connect_to_leader(rendezvous: FolderRendezvous, *, job_id, timeout_s=DEFAULT_TIMEOUT_S):
    """Waits for the leader of this launch; returns (LeaderAddress, a TCPStore client of it).
    Raises RendezvousError naming what was last seen when `timeout_s` passes."""
    import torch.distributed as dist
    deadline = time.monotonic() + timeout_s
    last = "no leader.json yet"
    while time.monotonic() < deadline:
        leader = rendezvous.read()
        if leader is not None and leader.job_id == job_id:
            try:
                store = dist.TCPStore(leader.addr, leader.port, leader.world_size, is_master=False,
                                      timeout=datetime.timedelta(seconds=5))
                if store.get(NONCE_KEY).decode() == leader.nonce:
                    store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
                    return leader, store
                last = f"the store at {leader.addr}:{leader.port} belongs to another attempt"
            except (RuntimeError, OSError) as exc:  # a stale file's store is gone
                last = f"the store at {leader.addr}:{leader.port} did not answer ({exc})"
        elif leader is not None:
            last = f"leader.json names job {leader.job_id!r}"
        time.sleep(POLL_S)
    raise RendezvousError(f"no leader for job {job_id!r} in {rendezvous.folder} within "
                          f"{timeout_s:.0f} s: {last}")


def node_address_default():
    """The address this node's ranks bind gloo to: MERIDIAN_NODE_ADDR, else 127.0.0.1."""
    return os.environ.get("MERIDIAN_NODE_ADDR", "127.0.0.1")
