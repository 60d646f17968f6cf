"""The real-node reconciler driving the real runtime (meridian-run, framework engine), no
control plane: desired state in, launches / stops / re-adoption out."""
import pathlib
import tempfile

import pytest
from agent_test_helpers import poll

from agent.node import NodeReconciler, pid_alive

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.runtime]


def entry(store, epochs=30):
    return {"job_id": 7, "action": "run", "world_size": 1, "devices": 1, "device_indices": [0],
            "entrypoint": "examples/train_mlp.py", "args": ["--epochs", str(epochs), "--step-sleep", "0.05"],
            "env": {}, "store": str(store)}


def by_id(entries):
    return {e["job_id"]: e for e in entries}


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
        finally:
            first.kill_all()
