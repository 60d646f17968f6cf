"""The leader's view of its followers (runtime/multihost.py JobPeers.lost_node), on a real TCP store."""
import torch.distributed as dist

from runtime.multihost import LOST_AFTER_S, JobPeers


def test_a_follower_that_finished_is_not_lost_but_a_silent_one_is():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    peers = JobPeers(store, nonce="n1", nodes=3, node_rank=0)
    store.set(peers._key("alive", 1), "7")
    store.set(peers._key("alive", 2), "7")
    assert peers.lost_node(100.0) is None  # first heard
    store.set(peers._key("finished", 1), "1")  # node 1's ranks finished; its launcher left
    store.set(peers._key("alive", 2), "8")
    assert peers.lost_node(100.0 + LOST_AFTER_S / 2) is None
    lost = peers.lost_node(100.0 + LOST_AFTER_S * 2)
    assert lost is not None and lost.startswith("node 2 sent no heartbeat")  # node 1 is not named


def test_a_host_that_failed_under_the_job_is_told_apart_from_a_failure_of_its_code():
    # Issue 18's soak: a follower whose agent froze fenced itself, and the leader failed the whole job
    # as if its code had failed; a host failing under the job must restart it from its checkpoint.
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    leader = JobPeers(store, nonce="n2", nodes=3, node_rank=0)
    crashed = JobPeers(store, nonce="n2", nodes=3, node_rank=1)
    crashed.report_failed("rank 1 exited with code 1")
    assert leader.check().startswith("node 1: rank 1 exited") and leader.host_failed is False
    store2 = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    leader = JobPeers(store2, nonce="n3", nodes=3, node_rank=0)
    fenced = JobPeers(store2, nonce="n3", nodes=3, node_rank=2)
    fenced.report_failed("no heartbeat answered for 12 s: fenced", host_failure=True)
    assert leader.check().startswith("node 2: no heartbeat") and leader.host_failed is True
