"""A real meridian-run job with a workspace: the script reads a relative input and writes
relative outputs; it is stopped at a checkpoint, its node's workspace is wiped (another node),
the agent's preparation is redone (bundle unpacked, as agent/bundles.py does on a fresh node),
and the resumed copy finds the outputs the checkpoint had, then finishes; final.json lists them."""
import json
import pathlib
import subprocess
import sys
import time

import pytest

from agent.bundles import prepare_workspace
from protocol import bundle
from runtime.control import JobControl, JobControlError
from runtime.criu import check_available
from runtime.workspace import Workspace, read_manifest

pytestmark = [pytest.mark.runtime, pytest.mark.slow]
ROOT = pathlib.Path(__file__).resolve().parents[2]
PROJECT = ROOT / "examples" / "project"
CRIU_OK, CRIU_DETAIL = check_available()
ENGINES = ["framework", pytest.param("criu", marks=[pytest.mark.criu, pytest.mark.skipif(
    not CRIU_OK, reason=f"CRIU unavailable: {CRIU_DETAIL}")])]


def _launch(tmp_path, name, workspace, outputs, store, *, resume=False, engine="framework"):
    job_dir = tmp_path / name
    command = [sys.executable, "-m", "runtime.launcher", "--ranks", "1", "--engine", engine,
               "--job-dir", str(job_dir), "--job-id", f"ws-{name}", "--store", str(store),
               "--workspace", str(workspace), "--outputs", str(outputs)]
    if resume:
        command.append("--resume")
    command += [str(workspace / "train.py"), "--epochs", "6", "--step-sleep", "0.05"]
    err = open(tmp_path / f"{name}.err", "wb")
    return subprocess.Popen(command, cwd=ROOT, stdout=err, stderr=subprocess.STDOUT), JobControl(job_dir)


def _wait_step(control, process, step, tmp_path, name):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, (tmp_path / f"{name}.err").read_text()
        try:
            if control.progress()["step"] >= step:
                return
        except (JobControlError, OSError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"never reached step {step}")


@pytest.mark.parametrize("engine", ENGINES)
def test_outputs_survive_a_stop_and_a_resume_on_another_node(tmp_path, monkeypatch, engine):
    monkeypatch.setenv("MERIDIAN_SPOOL_ROOT", str(tmp_path / "spool"))
    archive = tmp_path / "bundle.tar.gz"
    digest, _, _ = bundle.pack(PROJECT, archive)
    root, outputs, store = tmp_path / "workspaces", tmp_path / "outputs", tmp_path / "store"
    workspace = prepare_workspace(root=root, job_id=7, bundle_archive=archive, bundle_sha256=digest, resume=False)
    first, control = _launch(tmp_path, "a", workspace, outputs, store, engine=engine)
    _wait_step(control, first, 10, tmp_path, "a")
    started = (workspace / "outputs" / "started.txt").read_text()
    answer = control.stop(timeout_s=120)
    assert first.wait(timeout=60) == 75, (tmp_path / "a.err").read_text()
    checkpoint = pathlib.Path(answer["checkpoint"].removeprefix("file://"))
    manifest = json.loads((checkpoint / "MANIFEST.json").read_text())
    assert "workspace.json" in manifest["files"]  # the checkpoint is not complete without it
    saved = read_manifest(checkpoint / "workspace.json")
    assert {"train.py", "data/points.csv", "outputs/started.txt"} <= set(saved["files"])
    assert not (workspace / "outputs" / "metrics.json").exists()

    # "Another node": nothing of the workspace is left; the agent unpacks the bundle afresh.
    import shutil
    shutil.rmtree(root)
    workspace = prepare_workspace(root=root, job_id=7, bundle_archive=archive, bundle_sha256=digest, resume=True)
    assert not (workspace / "outputs").exists()
    second, control = _launch(tmp_path, "b", workspace, outputs, store, resume=True, engine=engine)
    assert second.wait(timeout=180) == 0, (tmp_path / "b.err").read_text()
    # The output written before the stop came back from the checkpoint (the script writes it
    # only when absent: a lost file would have been written anew by the second pid).
    assert (workspace / "outputs" / "started.txt").read_text() == started
    assert json.loads((workspace / "outputs" / "metrics.json").read_text())["epochs"] == 6
    final = read_manifest(outputs / "final.json")
    assert final["state"] == "finished" and "outputs/model.pt" in final["files"]
    fresh = Workspace(tmp_path / "download", outputs)
    fresh.restore(final)
    assert (fresh.path / "outputs" / "started.txt").read_text() == started


def test_a_workspace_over_its_quota_fails_the_job_naming_the_biggest_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MERIDIAN_SPOOL_ROOT", str(tmp_path / "spool"))
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "fill.py").write_text(
        "import time\nopen('huge.bin', 'wb').write(b'0' * 200_000)\n"
        "for _ in range(600):\n    time.sleep(0.1)\n")
    job_dir = tmp_path / "job"
    result = subprocess.run(
        [sys.executable, "-m", "runtime.launcher", "--ranks", "1", "--engine", "framework", "--job-dir", str(job_dir),
         "--job-id", "ws-quota", "--store", str(tmp_path / "store"), "--workspace", str(workspace),
         "--outputs", str(tmp_path / "outputs"), "--workspace-quota-bytes", "100000", str(workspace / "fill.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "above its quota of 97.7 KiB" in result.stderr and "huge.bin (195.3 KiB)" in result.stderr
    # What the job had is still kept for the user to see.
    assert "huge.bin" in read_manifest(tmp_path / "outputs" / "final.json")["files"]
