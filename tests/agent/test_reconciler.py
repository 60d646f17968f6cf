"""The real-node reconciler driving the real runtime (meridian-run; framework engine, and CRIU where it works), no
control plane: desired state in, launches / stops / re-adoption out."""
import json
import os
import pathlib
import tempfile
import time

import pytest
from polling import poll

from agent.node import NodeReconciler, pid_alive
from runtime.criu import check_available

CRIU_OK, CRIU_DETAIL = check_available()

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.runtime]


def entry(store, epochs=30):
    return {"job_id": 7, "action": "run", "world_size": 1, "devices": 1, "device_indices": [0],
            "entrypoint": "examples/train_mlp.py", "args": ["--epochs", str(epochs), "--step-sleep", "0.05"],
            "env": {}, "store": str(store)}


def by_id(reports):
    """Returns {job id: the report's wire dict}."""
    return {report.job_id: report.to_dict() for report in reports}


def test_a_restarted_agent_readopts_its_running_job_and_stops_it_with_a_checkpoint():
    with tempfile.TemporaryDirectory(prefix="rec-", dir="/tmp") as tmp:
        work, store = pathlib.Path(tmp) / "w", pathlib.Path(tmp) / "store"
        first = NodeReconciler(work, engine="framework", checkpoint_every_s=0, workload_root=ROOT)
        first.reconcile([entry(store)])
        launched = first.jobs[7]
        try:
            poll("the job to run", lambda: (by_id(first.observed())[7]["step"] or 0) >= 5)

            # The agent restarts: a new reconciler on the same work dir finds the launcher.
            second = NodeReconciler(work, engine="framework", checkpoint_every_s=0, workload_root=ROOT)
            assert list(second.jobs) == [7] and second.jobs[7].pid == launched.pid
            assert by_id(second.observed())[7]["state"] == "running"
            second.reconcile([entry(store)])  # desired unchanged: nothing new is launched
            assert len(list((work / "j").iterdir())) == 1

            second.reconcile([])  # no longer desired here: stopped at a consistent cut
            observed = poll("the stop", lambda: (lambda o: o if o["state"] == "stopped" else None)(
                by_id(second.observed())[7]))
            assert observed["checkpoint"]["step"] >= 5 and observed["checkpoint"]["uri"].startswith("file://")
            assert not pid_alive(launched.pid)
            # A stopped job resumes from its store later: forgetting it keeps the store.
            assert str(second.jobs[7].store) == str(store)  # known to the re-adopting agent too
            second.forget_reported({7})
            time.sleep(0.5)
            assert 7 not in second.jobs and list(store.glob("ckpt-*"))
        finally:
            first.kill_all()


@pytest.mark.criu
@pytest.mark.skipif(not CRIU_OK, reason=f"CRIU unavailable: {CRIU_DETAIL}")
def test_a_criu_job_stopped_by_one_node_resumes_on_another_at_its_cut():
    """The agent names every attempt's launcher anew (its job id, hence its spool): a CRIU
    image still restores, at the spool path its ranks were dumped with."""
    with tempfile.TemporaryDirectory(prefix="rec-", dir="/tmp") as tmp:
        tmp = pathlib.Path(tmp)
        store = tmp / "store" / "job-7"
        node_a = NodeReconciler(tmp / "a", engine="criu", checkpoint_every_s=0, workload_root=ROOT)
        node_b = NodeReconciler(tmp / "b", engine="criu", checkpoint_every_s=0, workload_root=ROOT)
        try:
            node_a.reconcile([{**entry(store / "g1", epochs=40), "generation": 1}])
            poll("the job to serve commands", lambda: (by_id(node_a.observed())[7]["step"] or 0) >= 5
                 and (node_a.jobs[7].job_dir / "control.sock").exists())
            node_a.reconcile([{"job_id": 7, "action": "stop", "generation": 1}])
            stopped = poll("the stop", lambda: (lambda o: o if o["state"] == "stopped" else None)(
                by_id(node_a.observed())[7]))
            assert stopped["engine"] == "criu" and stopped["checkpoint"]["engine"] == "criu"

            node_b.reconcile([{**entry(store / "g2", epochs=40), "generation": 2,
                               "restore_from": stopped["checkpoint"]["uri"],
                               "restore_sha256": stopped["checkpoint"]["sha256"]}])

            finished = poll("the resumed copy to finish", lambda: (lambda o: o if o["state"] in (
                "finished", "failed") else None)(by_id(node_b.observed())[7]))
            assert finished["state"] == "finished", finished.get("error")
            assert finished["restored_step"] == stopped["checkpoint"]["step"]
            assert finished["step"] > stopped["checkpoint"]["step"]
            # how it came back, for the job's "restored" event: whole processes, no GPU state here
            restore = finished["restore"]
            assert (restore["step"], restore["engine"], restore.get("device_in")) == (
                stopped["checkpoint"]["step"], "criu", None) and restore["seconds"] > 0
        finally:
            node_a.kill_all()
            node_b.kill_all()


@pytest.mark.parametrize("keep", [False, True])
def test_a_finished_jobs_store_is_removed_once_the_outcome_is_accepted_unless_kept(keep):
    with tempfile.TemporaryDirectory(prefix="rec-", dir="/tmp") as tmp:
        tmp = pathlib.Path(tmp)
        store = tmp / "store" / "job-7" / "g1"
        node = NodeReconciler(tmp / "w", engine="framework", checkpoint_every_s=0.5, workload_root=ROOT,
                              keep_finished_checkpoints=keep)
        desired = [{**entry(store, epochs=12), "generation": 1}]
        try:
            def finished():
                node.reconcile(desired)  # checkpoints every 0.5 s while it runs
                return (lambda o: o if o["state"] == "finished" else None)(by_id(node.observed())[7])

            report = poll("the job to finish", finished)
            assert report["checkpoint"]["uri"].startswith(store.as_uri())
            assert list(store.glob("ckpt-*")), "it checkpointed while it ran"

            node.forget_reported(set())  # not accepted yet: kept
            time.sleep(0.5)
            assert store.exists() and 7 in node.jobs
            node.forget_reported({7})

            assert 7 not in node.jobs
            # Still listed (a follower host forgets its share before the leader reports the job's end):
            # the generation that ended here is not launched again (the chaos soak saw it relaunched).
            node.reconcile(desired)
            assert 7 not in node.jobs and len(list((tmp / "w" / "j").iterdir())) == 1
            if keep:
                time.sleep(0.5)
                assert list(store.glob("ckpt-*"))
            else:
                poll("the store to go", lambda: not (tmp / "store" / "job-7").exists())
                assert (tmp / "store").exists()  # other jobs' stores are untouched
        finally:
            node.kill_all()


def test_a_copy_that_fenced_itself_while_the_agent_was_silent_is_forgotten_not_reported_failed():
    """A frozen agent cannot fence its jobs; their launchers do it themselves past the deadline the
    agent last wrote (runtime/fence.py). The agent, running again, forgets such a copy as it forgets
    one it fenced itself, and launches the job anew if it is still desired here."""
    from runtime import fence

    with tempfile.TemporaryDirectory(prefix="rec-", dir="/tmp") as tmp:
        work, store = pathlib.Path(tmp) / "w", pathlib.Path(tmp) / "store"
        node = NodeReconciler(work, engine="framework", checkpoint_every_s=0, workload_root=ROOT)
        fence.deadline_write(node.fence_file, time.monotonic() + 3600)
        node.reconcile([entry(store)])
        first = node.jobs[7]
        try:
            poll("the job to run", lambda: (by_id(node.observed())[7]["step"] or 0) >= 3)

            fence.deadline_write(node.fence_file, time.monotonic() - 60)  # what a frozen agent leaves behind
            poll("the launcher to fence itself", lambda: not pid_alive(first.pid))

            assert 7 not in by_id(node.observed())  # not "failed": forgotten
            assert 7 not in node.jobs and "self-fenced" in (first.job_dir / fence.FENCED_FILE).read_text()
            fence.deadline_write(node.fence_file, time.monotonic() + 3600)  # heard from the control plane again
            node.reconcile([entry(store)])
            assert node.jobs[7].job_dir != first.job_dir  # a new attempt
        finally:
            node.kill_all()


def test_the_checkpoint_the_control_plane_accepted_outlives_the_copys_own_retention():
    """A copy cut off from its agent commits on for seconds before it fences itself; the control
    plane restores elsewhere from the checkpoint it accepted last. The agent names that one in the
    copy's folder, and the launcher's store never prunes it (the chaos soak saw it pruned: "restore
    refused: ... is not a committed checkpoint this node can see")."""
    with tempfile.TemporaryDirectory(prefix="rec-", dir="/tmp") as tmp:
        tmp = pathlib.Path(tmp)
        store = tmp / "store" / "job-7" / "g1"
        node = NodeReconciler(tmp / "w", engine="framework", checkpoint_every_s=0.3, workload_root=ROOT)
        desired = {**entry(store, epochs=60), "generation": 1}
        try:
            def checkpoints():
                node.reconcile([desired])
                return sorted(p.name for p in store.glob("ckpt-*"))

            first = poll("a first checkpoint", lambda: checkpoints() or None)[0]
            desired["restore_from"] = (store / first).as_uri()  # accepted; nothing after it is
            node.reconcile([desired])
            assert (node.jobs[7].job_dir / "accepted-checkpoint").read_text().strip() == first
            later = poll("six checkpoints after it (the launcher keeps 3 of its own)",
                         lambda: (lambda names: names if len(names) >= 7 else None)(checkpoints()))
            assert later[0] == first, later
            # Accepted further on: what is older than the newest accepted one goes at the next commit.
            desired["restore_from"] = (store / later[-1]).as_uri()
            poll("the older ones to be pruned", lambda: first not in checkpoints() and len(checkpoints()) <= 4)
        finally:
            node.kill_all()


def test_a_copy_that_ended_while_the_agent_was_down_is_reported_by_the_restarted_agent_once():
    """The chaos soak restarted an agent while its copy finished: the new agent re-adopted only live
    launchers, never reported the outcome, and the job failed."""
    with tempfile.TemporaryDirectory(prefix="rec-", dir="/tmp") as tmp:
        tmp = pathlib.Path(tmp)
        work, store = tmp / "w", tmp / "store" / "job-7" / "g1"
        desired = [{**entry(store, epochs=3), "generation": 1}]
        first = NodeReconciler(work, engine="framework", checkpoint_every_s=0, workload_root=ROOT)
        try:
            first.reconcile(desired)
            launched = first.jobs[7]
            poll("the copy to end unwatched (the agent is 'down')", lambda: not pid_alive(launched.pid))

            second = NodeReconciler(work, engine="framework", checkpoint_every_s=0, workload_root=ROOT)
            report = by_id(second.observed())[7]
            assert report["state"] == "finished" and report["generation"] == 1, report
            second.reconcile(desired)  # reported, not relaunched
            assert len(list((work / "j").iterdir())) == 1
            second.forget_reported({7})
            assert 7 not in second.jobs

            third = NodeReconciler(work, engine="framework", checkpoint_every_s=0, workload_root=ROOT)
            assert 7 not in third.jobs and 7 not in by_id(third.observed())  # accepted: not reported again
            third.reconcile(desired)  # its generation ended here: not launched again
            assert 7 not in third.jobs and len(list((work / "j").iterdir())) == 1
        finally:
            first.kill_all()


@pytest.mark.parametrize("follower", [True, False])
def test_only_the_leaders_accepted_end_removes_a_finished_jobs_store(follower, tmp_path):
    """A follower host's share ending is not the job's end: the 30-minute soak saw a follower remove the
    store while the leader's report of the end (re-adopted after its agent's restart) was still to come."""
    from agent.node import LocalJob
    from protocol.states import CopyState

    node = NodeReconciler(tmp_path / "w", engine="framework", checkpoint_every_s=0, workload_root=ROOT)
    store = tmp_path / "store" / "job-7" / "g1"
    (store / "ckpt-000000000003-1").mkdir(parents=True)
    job = LocalJob(7, tmp_path / "w" / "j" / "7.1", generation=1, store=store)
    job.job_dir.mkdir(parents=True)
    job.follower, job.reported_state = follower, CopyState.FINISHED
    node.jobs[7] = job
    node.forget_reported({7})
    time.sleep(0.5)
    assert 7 not in node.jobs
    assert store.exists() is follower


def follower_entry(store, rendezvous):
    """Job 9's share on a second host (generation 4): its launcher waits in the rendezvous for a
    leader that never comes, so it lives on without having written launcher.json."""
    return {"job_id": 9, "action": "run", "world_size": 2, "devices": 1, "generation": 4, "device_indices": [0],
            "entrypoint": "examples/train_mlp.py", "args": ["--epochs", "3"], "env": {}, "store": str(store),
            "span": {"nodes": 2, "node_rank": 1, "first_rank": 1, "ranks": 1, "job_devices": 2, "leader": "mh-0",
                     "rendezvous": str(rendezvous)}}


def test_a_launcher_whose_pid_the_killed_agent_never_recorded_is_adopted_not_started_twice(tmp_path):
    work = tmp_path / "w"
    first = NodeReconciler(work, engine="framework", checkpoint_every_s=0, workload_root=ROOT)
    desired = [follower_entry(tmp_path / "store", tmp_path / "rendezvous")]
    first.reconcile(desired)
    launched = first.jobs[9]
    try:
        job_dir = launched.job_dir
        assert pid_alive(launched.pid) and not (job_dir / "launcher.json").exists()
        # What the agent leaves when it is killed between starting the launcher and recording its pid:
        # agent.json as written before the launcher started.
        meta = json.loads((job_dir / "agent.json").read_text())
        (job_dir / "agent.json").write_text(json.dumps({**meta, "pid": None}))

        second = NodeReconciler(work, engine="framework", checkpoint_every_s=0, workload_root=ROOT)
        assert list(second.jobs) == [9] and second.jobs[9].pid == launched.pid and second.jobs[9].follower
        assert json.loads((job_dir / "agent.json").read_text())["pid"] == launched.pid  # for the log shipper too
        second.reconcile(desired)
        assert [p.name for p in (work / "j").iterdir()] == [job_dir.name]  # nothing launched beside it
        assert by_id(second.observed())[9]["state"] == "starting"
    finally:
        first.kill_all()


def test_a_hosts_share_waits_for_the_launcher_holding_its_spool_and_adopts_an_untracked_one(tmp_path):
    """The chaos soak: an agent started a job's share again while the previous launcher of the same
    generation still held its spool; the new launcher refused to start and the job failed."""
    from runtime import rank as rank_liveness

    work = tmp_path / "w"
    agent = NodeReconciler(work, engine="framework", checkpoint_every_s=0, workload_root=ROOT)
    other = NodeReconciler(work, engine="framework", checkpoint_every_s=0, workload_root=ROOT)
    desired = [follower_entry(tmp_path / "store", tmp_path / "rendezvous")]
    lock = rank_liveness.hold_launcher_lock(work / "spool" / "j9-g4")  # a launcher of generation 4, ending
    try:
        agent.reconcile(desired)
        assert 9 not in agent.jobs and not list((work / "j").iterdir())  # nothing launched over it
        waiting = by_id(agent.observed())[9]
        assert waiting["state"] == "starting" and "previous launcher of generation 4" in waiting["waiting"]
        os.close(lock)
        lock = None

        agent.reconcile(desired)
        assert pid_alive(agent.jobs[9].pid) and 9 not in agent.waiting
        # Another agent process on this node (it knew of no launcher when it started) finds the launcher
        # of the generation it is asked to run, and adopts it instead of starting a second one.
        other.reconcile(desired)
        assert other.jobs[9].pid == agent.jobs[9].pid and len(list((work / "j").iterdir())) == 1
    finally:
        if lock is not None:
            os.close(lock)
        agent.kill_all()
