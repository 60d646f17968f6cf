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
