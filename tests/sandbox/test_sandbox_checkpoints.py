"""Checkpoints of sandboxed jobs: CRIU (as root) dumps ranks that run as the job's uid in the job's
cgroup and restores them on another node, into that node's cgroup for the job, on its devices'
cores; the framework engine's ranks write their checkpoint into a staging folder they are given,
which the launcher seals before the commit. Both bit-exact against an uninterrupted run."""
import json
import os

import pytest
import torch
from polling import poll
from sandbox_helpers import ROOT, UID_BASE, entry, make_node, needs_sandbox, outcome, workspace

from agent import sandbox as agent_sandbox
from runtime import sandbox as mechanisms
from runtime.criu import check_available

CRIU_OK, CRIU_DETAIL = check_available()
CRIU_OTHER_UIDS_REFUSAL = mechanisms.criu_refusal_for_other_uids()
CRIU_SANDBOX_REFUSAL = mechanisms.criu_refusal_for_sandbox()
TRAIN = ROOT / "examples" / "train_mlp.py"
pytestmark = [pytest.mark.runtime, needs_sandbox]


def _train_entry(job_id, store, out, *, indices, generation=1, **fields):
    return {**entry(job_id, store, script=TRAIN, world_size=2, indices=indices, generation=generation,
                    args=["--out", out, "--epochs", "8", "--step-sleep", "0.05"]), **fields}


def _rank_pids(node, job_id):
    from agent.node import read_progress
    progress = read_progress(node.jobs[job_id].job_dir)
    return list(progress.rank_pids) if progress and progress.rank_pids else []


def _uids_and_cgroups(pids):
    seen = []
    for pid in pids:
        with open(f"/proc/{pid}/status") as handle:
            uid = next(int(line.split()[1]) for line in handle if line.startswith("Uid:"))
        with open(f"/proc/{pid}/cgroup") as handle:
            cpuset = next(line.split(":", 2)[2].strip() for line in handle if ":cpuset:" in line)
        seen.append((uid, cpuset, tuple(sorted(os.sched_getaffinity(pid)))))
    return seen


def _stop_on_a_and_finish_on_b(node_root, engine, job_id):
    store, outputs = node_root / "store", {}
    node_a = make_node(node_root / "a", engine=engine)
    node_b = make_node(node_root / "b", engine=engine)
    reference = make_node(node_root / "ref", engine=engine)
    uid = mechanisms.identity_for_job(job_id, base=UID_BASE).uid
    try:
        space_a = workspace(node_root / "a", job_id)
        workspace(node_root / "b", job_id)
        space_ref = workspace(node_root / "ref", job_id + 1)
        reference.reconcile([_train_entry(job_id + 1, store, space_ref / "final.pt", indices=(1,))])
        node_a.reconcile([_train_entry(job_id, store, space_a / "final.pt", indices=(0,))])

        def running():
            report = {r.job_id: r.to_dict() for r in node_a.observed()}[job_id]
            return (report["step"] or 0) >= 5 and (node_a.jobs[job_id].job_dir / "control.sock").exists()
        poll("the job to run", running)
        before = _uids_and_cgroups(_rank_pids(node_a, job_id))
        assert [u for u, _, _ in before] == [uid, uid]
        assert all(cores == (0,) for _, _, cores in before)
        node_a.reconcile([{"job_id": job_id, "action": "stop", "generation": 1}])
        stopped = outcome(node_a, job_id)
        assert stopped["state"] == "stopped", stopped.get("error")
        # a stop for a move: the ranks' private /tmp and /dev/shm on a are gone with them
        launched = json.loads((node_a.jobs[job_id].job_dir / "launcher.json").read_text())
        assert not os.path.exists(launched["private_tmp"]) and not os.path.exists(launched["private_shm"])
        assert stopped["checkpoint"]["engine"] == engine

        # The workspace (outputs) follows the job: here, by hand (the workspace code does it).
        node_b.reconcile([_train_entry(job_id, store, space_a / "final.pt", indices=(1,), generation=2,
                                       restore_from=stopped["checkpoint"]["uri"],
                                       restore_sha256=stopped["checkpoint"]["sha256"])])
        os.makedirs(space_a, exist_ok=True)

        def resumed():
            report = {r.job_id: r.to_dict() for r in node_b.observed()}[job_id]
            return report if report["state"] != "starting" and _rank_pids(node_b, job_id) else None
        report = poll("the copy on b to run", resumed)
        assert report["state"] in ("running", "finished"), report.get("error")
        def dropped():
            """The ranks' (uid, cpuset, cores) once none is root any more, "finished" once the job is
            done. A rank starts as root in the private-dirs helper (its mounts), which then execs
            setpriv: read too early, the same pid is still uid 0."""
            if {r.job_id: r.to_dict() for r in node_b.observed()}[job_id]["state"] != "running":
                return "finished"
            try:
                seen = _uids_and_cgroups(_rank_pids(node_b, job_id))
            except (FileNotFoundError, ProcessLookupError):
                return None
            return seen if seen and all(u != 0 for u, _, _ in seen) else None
        after = poll("the ranks on b to run as the job's uid", dropped, timeout=60) \
            if report["state"] == "running" else "finished"
        if after != "finished":
            cgroup_b = agent_sandbox.cgroup_of(node_b.jobs[job_id].job_dir)
            assert [u for u, _, _ in after] == [uid, uid]
            assert all(cores == (1,) for _, _, cores in after)  # b's device 1
            assert set(_rank_pids(node_b, job_id)) <= cgroup_b.pids()
            outputs["cpusets"] = (before[0][1], after[0][1])
        finished = outcome(node_b, job_id)
        assert finished["state"] == "finished", finished.get("error")
        assert finished["restored_step"] == stopped["checkpoint"]["step"]
        assert outcome(reference, job_id + 1)["state"] == "finished"
    finally:
        for node in (node_a, node_b, reference):
            node.kill_all()
    got = torch.load(space_a / "final.pt", weights_only=True)
    want = torch.load(space_ref / "final.pt", weights_only=True)
    for name in want["params"]:
        assert torch.equal(got["params"][name], want["params"][name]), name
    return outputs


@pytest.mark.criu
@pytest.mark.skipif(not CRIU_OK, reason=f"CRIU unavailable: {CRIU_DETAIL}")
@pytest.mark.skipif(CRIU_SANDBOX_REFUSAL is not None, reason=f"REFUSED, NOT RUN: {CRIU_SANDBOX_REFUSAL}")
def test_criu_dumps_a_sandboxed_job_and_restores_it_on_another_node_bit_exactly(node_root):
    _stop_on_a_and_finish_on_b(node_root, "criu", 71)


def test_the_framework_engine_checkpoints_a_sandboxed_job_and_resumes_it_bit_exactly(node_root):
    _stop_on_a_and_finish_on_b(node_root, "framework", 81)
    committed = [p for p in (node_root / "store" / "job-81" / "g1").iterdir() if p.name.startswith("ckpt-")]
    assert committed
    for path in committed[0].rglob("*"):  # sealed: root's, the job's group may read, nobody may write
        info = path.lstat()
        assert info.st_uid == 0 and not info.st_mode & 0o022, path


def test_where_criu_cannot_dump_a_sandboxed_rank_auto_takes_the_framework_engine_and_says_why(node_root):
    """CRIU is not built for the sandbox's private /tmp and /dev/shm (and this machine's root lacks
    CAP_SYS_RESOURCE): a sandboxed job under --engine auto runs with the framework engine, and its
    Started event says why; --engine criu is refused with the reason."""
    work, store = node_root / "w", node_root / "store"
    auto, criu_node = make_node(work, engine="auto"), make_node(node_root / "c", engine="criu")
    try:
        workspace(work, 91)
        auto.reconcile([entry(91, store, args=["probe"])])
        criu_node.reconcile([entry(92, store, args=["probe"])])
        assert outcome(auto, 91)["state"] == "finished"
        refused = outcome(criu_node, 92)
    finally:
        auto.kill_all()
        criu_node.kill_all()
    started = [json.loads(line) for line in (auto.jobs[91].job_dir / "events.jsonl").read_text().splitlines()][0]
    why = "CAP_SYS_RESOURCE" if CRIU_OTHER_UIDS_REFUSAL else "CRIU is not built for sandboxed ranks"
    assert started["engine"] == "framework" and why in started["reason"]
    assert "external mounts" in started["reason"]
    assert started["sandbox"].startswith("uid ")
    assert refused["state"] == "failed" and why in refused["error"]


def test_seal_refuses_a_link_a_rank_left_in_its_checkpoint(tmp_path):
    staging = tmp_path / "staging"
    (staging / "rank-0").mkdir(parents=True)
    (staging / "rank-0" / "state.pt").write_bytes(b"weights")
    (staging / "rank-0" / "token").symlink_to("/etc/shadow")
    with pytest.raises(mechanisms.SandboxError, match="links and devices are refused"):
        mechanisms.seal_tree(staging, gid=12345)
    assert not (staging / "rank-0" / "token").is_symlink()
    assert (staging / "rank-0" / "state.pt").stat().st_gid == 12345


def test_the_launcher_reads_no_rank_file_through_a_link(tmp_path):
    (tmp_path / "out.log").symlink_to("/etc/shadow")
    with pytest.raises(OSError):
        mechanisms.read_job_file(tmp_path / "out.log")
    with pytest.raises(OSError):
        mechanisms.copy_job_file(tmp_path / "out.log", tmp_path / "copy")
