"""Checkpoints of sandboxed jobs: CRIU, run as the job's uid (runtime/criu.py), dumps ranks that run
as that uid in the job's cgroup, its network namespace and their own PID and mount namespaces with
the job's private /tmp and /dev/shm, and restores them on another node onto that node's new private
folders (their contents carried), into its cgroup for the job, on its devices' cores, checked before
they run; the framework engine's ranks write their checkpoint into a staging folder they are given,
which the launcher seals before the commit. Both bit-exact against an uninterrupted run."""
import json
import os

import pytest
import torch
from criu_images import tamper_core_image
from polling import poll
from sandbox_helpers import ROOT, SCRIPTS, UID_BASE, entry, make_node, needs_sandbox, outcome, workspace

from agent import sandbox as agent_sandbox
from runtime import sandbox as mechanisms
from runtime import store as checkpoint_store
from runtime.criu import check_available

CRIU_OK, CRIU_DETAIL = check_available()
TRAIN = ROOT / "examples" / "train_mlp.py"
HOLDING_TMP = SCRIPTS / "train_holding_tmp.py"  # train_mlp.py holding files open in /tmp and /dev/shm
CAP_SYS_ADMIN = 21
needs_criu = pytest.mark.skipif(not CRIU_OK, reason=f"CRIU unavailable: {CRIU_DETAIL}")
pytestmark = [pytest.mark.runtime, needs_sandbox]


def _train_entry(job_id, store, out, *, indices, generation=1, script=TRAIN, epochs=8, **fields):
    return {**entry(job_id, store, script=script, world_size=2, indices=indices, generation=generation,
                    args=["--out", out, "--epochs", str(epochs), "--step-sleep", "0.05"]), **fields}


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


def _diagnose(job_dir):
    """The tails of what a launcher wrote in its job dir (events, its output, criu's restore logs)."""
    text = ""
    for path in sorted(job_dir.rglob("*")):
        if path.is_file() and path.suffix in (".jsonl", ".log", ".err", ".out", ".json"):
            text += f"--- {path} ---\n" + "".join(path.read_text(errors="replace").splitlines(True)[-12:])
    return text


def _confinement(pid, launcher_pid):
    """What a (restored) rank holds: its capability sets and no_new_privs, whether its PID and mount
    namespaces are its own and its network namespace its launcher's, and the interfaces it sees."""
    with open(f"/proc/{pid}/status") as handle:
        status = dict(line.rstrip("\n").split(":\t", 1) for line in handle if ":\t" in line)
    namespace = {name: os.readlink(f"/proc/{pid}/ns/{name}") for name in ("pid", "mnt", "net")}
    launcher = {name: os.readlink(f"/proc/{launcher_pid}/ns/{name}") for name in ("pid", "mnt", "net")}
    with open(f"/proc/{pid}/net/dev") as handle:
        interfaces = sorted(line.split(":")[0].strip() for line in handle.readlines()[2:])
    return {"caps": {f: int(status[f], 16) for f in ("CapInh", "CapPrm", "CapEff", "CapAmb")},
            "no_new_privs": status["NoNewPrivs"].strip(), "interfaces": interfaces,
            "own_pid_ns": namespace["pid"] != launcher["pid"], "own_mnt_ns": namespace["mnt"] != launcher["mnt"],
            "launcher_net_ns": namespace["net"] == launcher["net"],
            "node_net_ns": namespace["net"] == os.readlink("/proc/self/ns/net")}


def _stop_on_a_and_finish_on_b(node_root, engine, job_id, *, script=TRAIN, epochs=8, via_m=False):
    """Starts the job on a, stops it there and finishes it on b (with `via_m`, restored on m in
    between, run on and stopped again there: a checkpoint of a restored copy); returns what it saw."""
    store, outputs = node_root / "store", {}
    node_m = make_node(node_root / "m", engine=engine) if via_m else None
    node_a = make_node(node_root / "a", engine=engine)
    node_b = make_node(node_root / "b", engine=engine)
    reference = make_node(node_root / "ref", engine=engine)
    uid = mechanisms.identity_for_job(job_id, base=UID_BASE).uid
    try:
        space_a = workspace(node_root / "a", job_id)
        workspace(node_root / "b", job_id)
        space_ref = workspace(node_root / "ref", job_id + 1)
        reference.reconcile([_train_entry(job_id + 1, store, space_ref / "final.pt", indices=(1,), script=script,
                                          epochs=epochs)])
        node_a.reconcile([_train_entry(job_id, store, space_a / "final.pt", indices=(0,), script=script,
                                       epochs=epochs)])

        def running():
            report = {r.job_id: r.to_dict() for r in node_a.observed()}[job_id]
            assert report["state"] != "failed", report.get("error")
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
        outputs["left_out"] = [stopped["checkpoint"].get("left_out")]
        generation = 2
        if node_m is not None:
            workspace(node_root / "m", job_id)
            node_m.reconcile([_train_entry(job_id, store, space_a / "final.pt", indices=(0,), generation=2,
                                           script=script, epochs=epochs, restore_from=stopped["checkpoint"]["uri"],
                                           restore_sha256=stopped["checkpoint"]["sha256"])])

            def further():
                report = {r.job_id: r.to_dict() for r in node_m.observed()}[job_id]
                assert report["state"] not in ("failed", "finished"), report.get("error")
                return (report["step"] or 0) >= stopped["checkpoint"]["step"] + 3 \
                    and (node_m.jobs[job_id].job_dir / "control.sock").exists()
            poll("the copy restored on m to run on", further)
            node_m.reconcile([{"job_id": job_id, "action": "stop", "generation": 2}])
            stopped = outcome(node_m, job_id)
            assert stopped["state"] == "stopped", stopped.get("error")
            outputs["left_out"].append(stopped["checkpoint"].get("left_out"))
            generation = 3

        # The workspace (outputs) follows the job: here, by hand (the workspace code does it).
        node_b.reconcile([_train_entry(job_id, store, space_a / "final.pt", indices=(1,), generation=generation,
                                       script=script, epochs=epochs, restore_from=stopped["checkpoint"]["uri"],
                                       restore_sha256=stopped["checkpoint"]["sha256"])])
        os.makedirs(space_a, exist_ok=True)

        def resumed():
            report = {r.job_id: r.to_dict() for r in node_b.observed()}[job_id]
            return report if report["state"] != "starting" and _rank_pids(node_b, job_id) else None
        report = poll("the copy on b to run", resumed, on_timeout=lambda: _diagnose(node_b.jobs[job_id].job_dir))
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
            outputs["confinement"] = [_confinement(pid, node_b.jobs[job_id].pid) for pid in _rank_pids(node_b, job_id)]
        finished = outcome(node_b, job_id)
        assert finished["state"] == "finished", finished.get("error")
        assert finished["restored_step"] == stopped["checkpoint"]["step"]
        restore = finished["restore"]  # the job's "restored" event: the way back, stage by stage
        assert (restore["step"], restore["engine"]) == (stopped["checkpoint"]["step"], engine), restore
        if engine == "framework":  # the sandboxed ranks said how their state came back
            assert restore["load_s"] > 0 and restore["apply_s"] > 0 and restore["device_bytes"] == 0, restore
        assert outcome(reference, job_id + 1)["state"] == "finished"
    finally:
        for node in (node_a, node_b, reference, *([node_m] if node_m else [])):
            node.kill_all()
    got = torch.load(space_a / "final.pt", weights_only=True)
    want = torch.load(space_ref / "final.pt", weights_only=True)
    for name in want["params"]:
        assert torch.equal(got["params"][name], want["params"][name]), name
    outputs["held"] = {rank: (json.loads((space_a / f"final.pt.held-rank{rank}.json").read_text()),
                              json.loads((space_ref / f"final.pt.held-rank{rank}.json").read_text()))
                       for rank in (0, 1) if script == HOLDING_TMP}
    return outputs


@pytest.mark.criu
@needs_criu
def test_criu_dumps_a_sandboxed_job_and_restores_it_on_another_node_bit_exactly(node_root):
    """Stopped on a, restored on m and stopped again there (a restored rank's namespace is dumped in
    turn: found failing before the restore's --root was the node's root alone), restored on b onto
    b's new private /tmp and /dev/shm: the files each rank held
    open there since it started come back with what they held (each rank's count of lines equals the
    uninterrupted run's), the final parameters equal the uninterrupted run's, and the restored ranks
    run as the job's uid with no capability, in PID and mount namespaces of their own and in their
    launcher's network namespace (loopback only, not the node's)."""
    outputs = _stop_on_a_and_finish_on_b(node_root, "criu", 71, script=HOLDING_TMP, epochs=10, via_m=True)
    for rank, (got, want) in outputs["held"].items():
        assert got == want and min(got.values()) > 0, (rank, got, want)
    # Each rank's stale socket file is left out of a's checkpoint, and said so in the agent's report
    # (and so in the job's checkpointed event); m's copy never had them, so its checkpoint left nothing out.
    first, second = outputs["left_out"]
    assert [line.split(":")[0] for line in first] == ["/tmp/stale-rank0.sock", "/tmp/stale-rank1.sock"], first
    assert all("stale unix socket file" in line for line in first) and not second, outputs["left_out"]
    assert "confinement" in outputs, "the restored job finished before its ranks could be looked at"
    for seen in outputs["confinement"]:
        assert seen["caps"] == {"CapInh": 0, "CapPrm": 0, "CapEff": 0, "CapAmb": 0}, seen
        assert seen["no_new_privs"] == "1" and seen["own_pid_ns"] and seen["own_mnt_ns"], seen
        assert seen["launcher_net_ns"] and not seen["node_net_ns"] and seen["interfaces"] == ["lo"], seen


@pytest.mark.criu
@needs_criu
def test_a_criu_image_edited_to_hold_a_capability_is_refused_before_the_rank_runs(node_root):
    """The images are written by the job's uid (criu runs as it), and a rank parked at the cut could
    edit another's before they are sealed and hashed. Here rank 0's core image is edited to hold
    CAP_SYS_ADMIN, which criu (holding it while it restores) would hand the restored task, and the
    manifest rewritten as if the edit came before the commit: the restore on b is refused, naming the
    capability, and no restored rank is left."""
    job_id = 75
    store = node_root / "store"
    node_a, node_b = make_node(node_root / "a", engine="criu"), make_node(node_root / "b", engine="criu")
    try:
        space = workspace(node_root / "a", job_id)
        workspace(node_root / "b", job_id)
        node_a.reconcile([_train_entry(job_id, store, space / "final.pt", indices=(0,), epochs=30)])
        def running():
            report = {r.job_id: r.to_dict() for r in node_a.observed()}[job_id]
            assert report["state"] != "failed", report.get("error")
            return (report["step"] or 0) >= 3 and (node_a.jobs[job_id].job_dir / "control.sock").exists()
        poll("the job to run", running)
        node_a.reconcile([{"job_id": job_id, "action": "stop", "generation": 1}])
        stopped = outcome(node_a, job_id)
        assert stopped["state"] == "stopped" and stopped["checkpoint"]["engine"] == "criu", stopped
        checkpoint = next(p for p in (store / f"job-{job_id}" / "g1").iterdir() if p.name.startswith("ckpt-"))
        uid = mechanisms.identity_for_job(job_id, base=UID_BASE).uid
        tamper_core_image(checkpoint / "rank0" / "core-1.img", uid=uid, caps_low_word=1 << CAP_SYS_ADMIN)
        manifest = checkpoint_store.read_manifest(checkpoint)
        files = dict(manifest["files"], **checkpoint_store.hash_tree(checkpoint))
        checkpoint_store.write_manifest(checkpoint, files, **{k: v for k, v in manifest.items()
                                                              if k not in ("format", "bytes", "files", "files_sha256")})
        node_b.reconcile([_train_entry(job_id, store, space / "final.pt", indices=(1,), generation=2, epochs=30,
                                       restore_from=stopped["checkpoint"]["uri"],
                                       restore_sha256=checkpoint_store.manifest_sha256(checkpoint))])
        refused = outcome(node_b, job_id)
        assert refused["state"] == "failed", refused
        assert "holds capabilities" in refused["error"] and "killed before it ran" in refused["error"], refused
        cgroup_b = agent_sandbox.cgroup_of(node_b.jobs[job_id].job_dir)
        assert not cgroup_b.pids()
    finally:
        node_a.kill_all()
        node_b.kill_all()


def test_the_framework_engine_checkpoints_a_sandboxed_job_and_resumes_it_bit_exactly(node_root):
    _stop_on_a_and_finish_on_b(node_root, "framework", 81)
    committed = [p for p in (node_root / "store" / "job-81" / "g1").iterdir() if p.name.startswith("ckpt-")]
    assert committed
    for path in committed[0].rglob("*"):  # sealed: root's, the job's group may read, nobody may write
        info = path.lstat()
        assert info.st_uid == 0 and not info.st_mode & 0o022, path


@needs_criu
def test_auto_takes_criu_for_a_sandboxed_job_on_one_host_and_says_why(node_root):
    """Where CRIU works, a sandboxed job on one host gets it under --engine auto, as an unsandboxed
    job does (criu runs as the job's uid), and --engine criu is not refused."""
    work, store = node_root / "w", node_root / "store"
    auto, criu_node = make_node(work, engine="auto"), make_node(node_root / "c", engine="criu")
    try:
        workspace(work, 91)
        auto.reconcile([entry(91, store, args=["probe"])])
        criu_node.reconcile([entry(92, store, args=["probe"])])
        assert outcome(auto, 91)["state"] == "finished"
        asked = outcome(criu_node, 92)
    finally:
        auto.kill_all()
        criu_node.kill_all()
    started = [json.loads(line) for line in (auto.jobs[91].job_dir / "events.jsonl").read_text().splitlines()][0]
    assert started["engine"] == "criu" and "passed `criu check`" in started["reason"], started
    assert started["sandbox"].startswith("uid ")
    assert asked["state"] == "finished", asked.get("error")
    assert mechanisms.criu_refusal_for_sandbox() is None


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


@needs_criu
def test_criu_is_not_refused_to_a_sandboxed_job_spanning_hosts_and_auto_says_why_it_takes_framework():
    """A sandboxed job spanning hosts may ask for CRIU (each host's part is dumped as the job's uid:
    tests/hosts/test_multihost_criu.py proves it); auto gives it the framework engine, as it does an
    unsandboxed one, saying why (CRIU's parts are stored whole, and some restores onto another host
    count are refused)."""
    import types

    from runtime import launcher

    def chosen(engine, nodes):
        sandbox = types.SimpleNamespace(identity=mechanisms.identity_for_job(7, base=UID_BASE))
        fake = types.SimpleNamespace(sandbox=sandbox, options=types.SimpleNamespace(engine=engine), nodes=nodes)
        return launcher.Launcher.choose_engine(fake)

    assert chosen("criu", 2)[0] == "criu"
    name, reason = chosen("auto", 2)
    assert name == "framework" and "spanning 2 hosts" in reason and "no page deduplication" in reason, reason
    assert chosen("criu", 1)[0] == "criu" and chosen("auto", 1)[0] == "criu"
