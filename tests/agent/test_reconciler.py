"""The real-node reconciler driving the real runtime (meridian-run; framework engine, and CRIU where it works), no
control plane: desired state in, launches / stops / re-adoption out."""
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
            if keep:
                time.sleep(0.5)
                assert list(store.glob("ckpt-*"))
            else:
                poll("the store to go", lambda: not (tmp / "store" / "job-7").exists())
                assert (tmp / "store").exists()  # other jobs' stores are untouched
        finally:
            node.kill_all()
