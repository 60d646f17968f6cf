"""The leader's view of its followers (runtime/multihost.py JobPeers.lost_node), on a real TCP store."""
import functools
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from runtime.exits import LaunchError
from runtime.multihost import LOST_AFTER_S, JobPeers, await_outcome, follow_cut


def two_host_launcher(job_id, node_rank):
    """What join_job reads of a launcher: node `node_rank` of a W = 4 job over two hosts."""
    return SimpleNamespace(job_id=job_id, node_rank=node_rank, node_addr="127.0.0.1", world_size=4, nodes=2,
                           nonce=f"own-{node_rank}", options=SimpleNamespace(rendezvous_timeout=10.0),
                           local_ranks=range(2 * node_rank, 2 * node_rank + 2))


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


def test_no_host_restores_before_every_host_checked_its_part_of_the_checkpoint():
    # runtime/criu_parts.py: each host checks only the part it restores, so the leader waits for
    # every follower's check before anyone restores; a bad part or a silent host refuses the resume.
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    leader, one, two = (JobPeers(store, nonce="r1", nodes=3, node_rank=node) for node in range(3))
    one.report_resume_checked()
    assert leader.await_resume_checked(timeout_s=0.3) == (
        "not every host checked its part of the checkpoint within 0 s", True)  # node 2 said nothing
    assert one.await_resume_go(timeout_s=0.2)[1] is True  # ... so nobody was let go
    two.report_resume_checked()
    assert leader.await_resume_checked(timeout_s=5) is None
    assert one.await_resume_go(timeout_s=5) is None and two.await_resume_go(timeout_s=5) is None

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    leader, one, two = (JobPeers(store, nonce="r2", nodes=3, node_rank=node) for node in range(3))
    one.report_resume_checked()
    two.report_failed("--resume: node 2 cannot restore its part of ckpt-6: node2/rank5/pages-1.img: sha256 …")
    why, host_failure = leader.await_resume_checked(timeout_s=5)
    assert why.startswith("node 2: --resume: node 2 cannot restore its part") and host_failure is False
    assert one.await_resume_go(timeout_s=5)[0].startswith("node 2:")  # node 1 restores nothing either


def test_a_rank_failure_explained_by_another_hosts_failure_is_told_apart_from_its_own():
    # A host killed under the job makes its peers' collectives fail at once, before it is found
    # silent: the launcher asks its peers before it blames its own rank (Launcher.check_ranks).
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    leader, follower = JobPeers(store, nonce="b1", nodes=2, node_rank=0), JobPeers(store, nonce="b1", nodes=2,
                                                                                    node_rank=1)
    assert leader.failure_behind(timeout_s=0.6) is None  # nobody else failed: its own failure
    follower.report_failed("fenced: no heartbeat answered", host_failure=True)
    assert leader.failure_behind(timeout_s=5).startswith("node 1: fenced") and leader.host_failed is True

    master = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", master.port, 1, is_master=False, timeout=timedelta(seconds=2))
    orphan = JobPeers(client, nonce="b2", nodes=2, node_rank=1)
    del master  # the leader's host, and the store it served, are gone
    why = orphan.failure_behind(timeout_s=10)
    assert why.startswith("the job's leader store is unreachable") and orphan.host_failed is True


def test_a_follower_busy_in_a_long_dump_beats_from_a_thread_and_falls_silent_once_it_stops(monkeypatch):
    # A follower's CRIU dump blocks its launcher's thread for longer than LOST_AFTER_S: without a
    # beat meanwhile the leader either takes it for lost, or (as before) ignores every silence in a
    # cut and waits for the cut's deadline when the host really died.
    import time

    from runtime import multihost

    monkeypatch.setattr(multihost, "LOST_AFTER_S", 0.6)
    monkeypatch.setattr(multihost, "PEER_CHECK_S", 0.05)
    master = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", master.port, 1, is_master=False, timeout=timedelta(seconds=2))
    leader = JobPeers(master, nonce="d1", nodes=2, node_rank=0)
    follower = JobPeers(client, nonce="d1", nodes=2, node_rank=1)
    assert follower.check() is None  # beats once
    with follower.beating():  # this thread is now "dumping": it never calls check()
        until = time.monotonic() + 2.0
        while time.monotonic() < until:
            assert leader.lost_node(time.monotonic()) is None
            time.sleep(0.05)
    until, lost = time.monotonic() + 3.0, None  # the dump is over; nothing beats (the host died)
    while lost is None and time.monotonic() < until:
        lost = leader.lost_node(time.monotonic())
        time.sleep(0.05)
    assert lost is not None and lost.startswith("node 1 sent no heartbeat")


def test_a_follower_whose_leader_store_is_gone_ends_as_a_host_failure_not_with_a_traceback():
    # Issue 14, on emulated hosts: the leader's host killed while it wrote its part of a checkpoint made
    # the follower's launcher die of the store's DistNetworkError (a traceback, no Failed event), so the
    # job was failed instead of restarted. Every read and write a follower makes in the loop and in a
    # cut (follow_cut, await_outcome) now says "the leader store is unreachable", as a host failure.
    master = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", master.port, 1, is_master=False, timeout=timedelta(seconds=2))
    follower = JobPeers(client, nonce="g1", nodes=2, node_rank=1)
    launcher = SimpleNamespace(peers=follower, last_request_id=0)  # what follow_cut reads of its launcher
    assert follow_cut(launcher) is None  # no cut handed out yet
    del master  # the leader's host, and the store it served, are gone
    launcher._cut_checked_at = 0.0  # its next look (follow_cut looks every FOLLOW_CHECK_S)
    for call in (lambda: follow_cut(launcher), lambda: await_outcome(launcher, 1), follower.report_finished):
        with pytest.raises(LaunchError) as caught:
            call()
        assert caught.value.host_failure is True and "leader store is unreachable" in str(caught.value)
    why, host_failure = follower.await_resume_go(timeout_s=5)
    assert why.startswith("the job's leader store is unreachable") and host_failure is True


def test_a_second_launch_of_one_hosts_part_cannot_join_the_running_group_and_every_host_restarts(tmp_path):
    # The soak on emulated hosts (job 206): an agent self-fenced, killed its part, and 2 s later
    # launched the same generation's part again; its ranks joined the leader's group under the
    # keys the killed ones had used, and DDP read another rank's data. A second join is refused,
    # as a host failure that every host hears: the job restarts from its checkpoint.
    from runtime.multihost import join_job

    launcher = functools.partial(two_host_launcher, "j206-g3")

    _store, _addr, _port, leader = join_job(launcher(0), tmp_path)
    first = launcher(1)
    join_job(first, tmp_path)
    assert first.nonce == "own-0"  # a follower takes the leader's nonce: one key prefix
    assert leader.check() is None

    with pytest.raises(LaunchError, match="already joined its leader once") as refused:
        join_job(launcher(1), tmp_path)

    assert refused.value.host_failure is True
    leader._checked_at = 0.0  # check() asks the store at most every PEER_CHECK_S
    said = leader.check()
    assert said is not None and said.startswith("node 1: node 1's part of this run already joined")
    assert leader.host_failed is True  # restarted from the checkpoint, not failed


def test_a_second_launch_of_a_part_that_finished_ends_without_failing_the_job(tmp_path):
    # The 30-minute soak (session 24, job 234): a follower's ranks finished and said so, its agent was
    # frozen, and the same part launched again while the leader waited for every host to finish;
    # claim_join told the leader of a failure and the leader failed a job whose every rank finished.
    from runtime.multihost import finish_node, join_job

    launcher = functools.partial(two_host_launcher, "j234-g2")

    _store, _addr, _port, leader = join_job(launcher(0), tmp_path)
    _store, _addr, _port, follower = join_job(launcher(1), tmp_path)
    finish_node(follower)

    with pytest.raises(LaunchError, match="already finished") as ended:
        join_job(launcher(1), tmp_path)

    assert ended.value.host_failure is False
    leader._checked_at = 0.0
    assert leader.check() is None
    finish_node(leader)  # every host finished: the leader ends the job, nothing raised


def test_a_host_failure_while_the_leader_waits_for_every_host_to_finish_restarts_the_job(tmp_path):
    # The same soak's job, had the follower's first launch died before it said its ranks finished:
    # the leader, done, met the second launch's refusal; a host failure, not the job's code.
    from runtime.multihost import finish_node, join_job

    launcher = functools.partial(two_host_launcher, "j234-g3")

    _store, _addr, _port, leader = join_job(launcher(0), tmp_path)
    join_job(launcher(1), tmp_path)
    with pytest.raises(LaunchError, match="already joined its leader once"):
        join_job(launcher(1), tmp_path)

    with pytest.raises(LaunchError, match="the job failed on another host") as failed:
        finish_node(leader)

    assert failed.value.host_failure is True


@pytest.mark.parametrize("blocks, problem", [
    ([range(0, 3), range(3, 4)], None),  # 3 + 1: unequal shares run
    ([range(0, 3), range(2, 4)], "node 1's overlaps the one before"),
    ([range(0, 2), range(3, 4)], "node 1's leaves a gap after the one before"),
], ids=["3+1", "overlap", "gap"])
def test_the_leader_fails_the_job_by_name_when_the_hosts_blocks_do_not_tile_its_ranks(tmp_path, blocks, problem):
    # Each host checks its own block (multihost.host_block); only the leader sees them all, once every
    # host joined: a rank run twice or never would hang the group or mix two copies' state.
    from runtime.multihost import join_job

    def launcher(node_rank):
        return SimpleNamespace(job_id="j9-g1", node_rank=node_rank, node_addr="127.0.0.1", world_size=4,
                               nodes=2, nonce="n", options=SimpleNamespace(rendezvous_timeout=10.0),
                               local_ranks=blocks[node_rank])

    _store, _addr, _port, leader = join_job(launcher(0), tmp_path)
    assert leader.check() is None  # node 1 has not joined: nothing to judge yet
    join_job(launcher(1), tmp_path)
    assert leader.blocks() == dict(enumerate(blocks))
    leader._checked_at = 0.0
    said = leader.check()
    if problem is None:
        assert said is None
    else:
        assert problem in said and "do not cover 0..3 once each" in said and leader.host_failed is False
