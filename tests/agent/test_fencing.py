"""Fencing on the node: the reconciler runs one placement generation per copy, reports it, stops a
copy a move takes off the node, and kills a fenced copy without a checkpoint. Real runtime
processes (meridian-run, framework engine); no control plane."""
import argparse
import json
import pathlib
import tempfile
import threading
import time

import pytest
from polling import poll

from agent.main import Agent
from agent.node import NodeReconciler, pid_alive, prune_older_generations, read_launch_events, seed_store
from runtime.store import CheckpointStore, manifest_sha256

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.runtime]


def entry(store, *, generation, action="run"):
    return {"job_id": 9, "action": action, "generation": generation, "world_size": 1, "devices": 1,
            "device_indices": [0], "entrypoint": "examples/train_mlp.py",
            "args": ["--epochs", "40", "--step-sleep", "0.05"], "env": {}, "store": str(store)}


def observed(reconciler):
    """Returns {job id: the report's wire dict}."""
    return {report.job_id: report.to_dict() for report in reconciler.observed()}


def test_a_fenced_copy_is_killed_without_a_checkpoint_and_forgotten():
    with tempfile.TemporaryDirectory(prefix="fen-", dir="/tmp") as tmp:
        work, store = pathlib.Path(tmp) / "w", pathlib.Path(tmp) / "store"
        node = NodeReconciler(work, engine="framework", checkpoint_every_s=0, workload_root=ROOT)
        try:
            node.reconcile([entry(store, generation=3) | {"log_grant": "c0" * 32}])
            copy = node.jobs[9]
            poll("the copy to run", lambda: (observed(node)[9]["step"] or 0) >= 3)
            assert observed(node)[9]["generation"] == 3
            meta = json.loads((copy.job_dir / "agent.json").read_text())
            assert (meta["generation"], meta["log_grant"]) == (3, "c0" * 32)  # what the log shipper sends

            assert node.fence({9}, why="generation 4 runs elsewhere") == [9]

            assert not pid_alive(copy.pid) and 9 not in node.jobs and node.observed() == []
            assert (copy.job_dir / "fenced").read_text() == "generation 4 runs elsewhere"
            assert not [e for e in read_launch_events(copy.job_dir) if e.event in ("checkpoint", "stopped")]
            assert not list(store.glob("ckpt-*"))
        finally:
            node.kill_all()


def test_a_stop_entry_stops_the_copy_at_a_consistent_cut_and_reports_the_cut():
    with tempfile.TemporaryDirectory(prefix="fen-", dir="/tmp") as tmp:
        work, store = pathlib.Path(tmp) / "w", pathlib.Path(tmp) / "store"
        node = NodeReconciler(work, engine="framework", checkpoint_every_s=0, workload_root=ROOT)
        try:
            node.reconcile([entry(store, generation=1)])
            poll("the copy to serve commands",
                 lambda: (observed(node)[9]["step"] or 0) >= 3 and (node.jobs[9].job_dir / "control.sock").exists())
            node.reconcile([{"job_id": 9, "action": "stop", "generation": 1}])  # a move's barrier
            report = poll("the stop", lambda: (lambda o: o if o["state"] == "stopped" else None)(observed(node)[9]))
            assert report["cut"]["action"] == "stop" and report["cut"]["step"] == report["checkpoint"]["step"]
            assert report["generation"] == 1
        finally:
            node.kill_all()


def test_an_agent_fences_itself_after_missing_heartbeats_for_the_lost_node_threshold():
    with tempfile.TemporaryDirectory(prefix="fen-", dir="/tmp") as tmp:
        options = argparse.Namespace(hostname="n1", work_dir=tmp, devices="cpu:1", control_plane="http://127.0.0.1:9",
                                     engine="framework", checkpoint_every=0.0, workload_root=str(ROOT), interval=1.0,
                                     keep_finished_checkpoints=False)
        agent = Agent(options, threading.Event())
        began = agent.last_heartbeat_ok
        assert not agent.self_fence_due(now=began + 1000)  # never told the threshold: never
        agent.lost_after_s = 8.0
        assert not agent.self_fence_due(now=began + 7.9)
        assert agent.self_fence_due(now=began + 8.1)


def test_a_new_generation_store_is_seeded_with_the_accepted_checkpoint_by_hard_links():
    with tempfile.TemporaryDirectory(prefix="fen-", dir="/tmp") as tmp:
        tmp = pathlib.Path(tmp)
        (tmp / "state").mkdir()
        (tmp / "state" / "rank-0.pt").write_bytes(b"weights" * 1000)
        old = CheckpointStore(tmp / "job-1" / "g1")
        accepted = old.commit(tmp / "state", 42, "framework", meta={"world_size": 1})
        old.commit(tmp / "state", 50, "framework", meta={"world_size": 1})  # never reported: not seeded

        seeded = seed_store(tmp / "job-1" / "g2", accepted.uri, manifest_sha256(accepted.path))

        new = CheckpointStore(tmp / "job-1" / "g2")
        newest = new.latest_good()  # verifies every file's sha256
        assert newest.step == 42 and newest.path == seeded
        assert (seeded / "rank-0.pt").stat().st_ino == (accepted.path / "rank-0.pt").stat().st_ino
        assert seed_store(tmp / "job-1" / "g2", accepted.uri, manifest_sha256(accepted.path)) == seeded  # idempotent
        with pytest.raises(ValueError):
            seed_store(tmp / "job-1" / "g3", (tmp / "state").as_uri(), manifest_sha256(accepted.path))


def commit_state(tmp, store, step):
    (tmp / "state").mkdir(exist_ok=True)
    (tmp / "state" / "rank-0.pt").write_bytes(b"weights %d" % step * 1000)
    return CheckpointStore(store).commit(tmp / "state", step, "framework", meta={"world_size": 1})


def test_older_generation_folders_go_once_a_newer_generation_holds_the_accepted_checkpoint():
    with tempfile.TemporaryDirectory(prefix="fen-", dir="/tmp") as tmp:
        tmp = pathlib.Path(tmp)
        job = tmp / "job-1"
        first = commit_state(tmp, job / "g1", 10)
        commit_state(tmp, job / "g1", 20)
        third = commit_state(tmp, job / "g1", 30)
        seed_store(job / "g2", third.uri, manifest_sha256(third.path))
        in_g2 = commit_state(tmp, job / "g2", 40)
        seed_store(job / "g3", in_g2.uri, manifest_sha256(in_g2.path))

        # Nothing older than the accepted checkpoint's generation: nothing goes.
        assert prune_older_generations(job / "g3", first.uri) == []
        # A checkpoint outside this job's generation folders, or of a newer generation than the
        # store's own, removes nothing.
        assert prune_older_generations(job / "g3", commit_state(tmp, tmp / "job-2" / "g1", 50).uri) == []
        assert prune_older_generations(job / "g1", in_g2.uri) == []
        assert prune_older_generations(job, in_g2.uri) == []
        assert sorted(p.name for p in job.iterdir()) == ["g1", "g2", "g3"]

        assert prune_older_generations(job / "g3", in_g2.uri) == [job / "g1"]

        assert sorted(p.name for p in job.iterdir()) == ["g2", "g3"]
        # The hard-linked seeds outlive the folder they came from, and still verify.
        assert CheckpointStore(job / "g3").latest_good().step == 40
        assert [ref.step for ref in CheckpointStore(job / "g2").list()] == [30, 40]


def test_the_reconciler_prunes_older_generations_of_a_job_it_runs():
    with tempfile.TemporaryDirectory(prefix="fen-", dir="/tmp") as tmp:
        tmp = pathlib.Path(tmp)
        job = tmp / "store" / "job-9"
        commit_state(tmp, job / "g1", 1)
        accepted = commit_state(tmp, job / "g2", 2)
        node = NodeReconciler(tmp / "w", engine="framework", checkpoint_every_s=0, workload_root=ROOT)
        try:
            desired = entry(job / "g3", generation=3)
            node.reconcile([desired])  # no accepted checkpoint yet: nothing to prune by
            time.sleep(0.5)
            assert (job / "g1").exists()
            seed_store(job / "g3", accepted.uri, manifest_sha256(accepted.path))

            node.reconcile([{**desired, "restore_from": accepted.uri,
                             "restore_sha256": manifest_sha256(accepted.path)}])

            poll("generation 1's folder to go", lambda: not (job / "g1").exists())
            assert sorted(p.name for p in job.iterdir()) == ["g2", "g3"]
        finally:
            node.kill_all()


def test_a_cancelled_copy_is_killed_without_a_checkpoint_and_its_store_removed():
    with tempfile.TemporaryDirectory(prefix="fen-", dir="/tmp") as tmp:
        tmp = pathlib.Path(tmp)
        store = tmp / "store" / "job-9" / "g1"
        node = NodeReconciler(tmp / "w", engine="framework", checkpoint_every_s=0.5, workload_root=ROOT)
        try:
            node.reconcile([entry(store, generation=1)])
            copy = node.jobs[9]
            poll("a periodic checkpoint", lambda: node.reconcile([entry(store, generation=1)]) or list(
                store.glob("ckpt-*")))

            assert node.fence({9}, why="the job was cancelled", remove_store=True) == [9]

            assert not pid_alive(copy.pid) and node.observed() == []
            poll("the store to go", lambda: not (tmp / "store" / "job-9").exists())
            assert (copy.job_dir / "fenced").read_text() == "the job was cancelled"
        finally:
            node.kill_all()
