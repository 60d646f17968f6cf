"""A rank's log across a stop and a restore, with either engine: the restored attempt's log
(what the agent ships for it) starts where the stopped one ended, and nothing is shipped twice.

CRIU restores a rank's open stdout file only at its old path and size: the launcher puts the log
carried in the checkpoint back at the spool path, links it into the new job directory, and
logs.json says that this attempt's output starts at its size. The framework engine starts the
script again with a new log file (start 0)."""
import os
import pathlib
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from agent.logs import LogShipper
from protocol.logs import LogBatchAnswer
from runtime import criu
from runtime.control import JobControl
from runtime.rank_logs import read_manifest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHATTY = pathlib.Path(__file__).with_name("chatty_train.py")
CRIU_OK, CRIU_DETAIL = criu.check_available()
pytestmark = [pytest.mark.runtime, pytest.mark.timeout(600)]


class Recorder:
    def __init__(self):
        self.chunks, self.token = [], None

    def logs(self, batch):
        self.chunks += batch.chunks
        return LogBatchAnswer(stored=len(batch.chunks))


def launch(job_dir, *, engine, store, spool_root, resume=False):
    env = {**os.environ, "MERIDIAN_SPOOL_ROOT": str(spool_root), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "runtime.launcher", "--ranks", "1", "--engine", engine, "--job-dir",
               str(job_dir), "--job-id", f"logs-{uuid.uuid4().hex[:6]}", "--store", str(store)]
    if resume:
        command.append("--resume")
    job_dir.parent.mkdir(parents=True, exist_ok=True)
    err = open(job_dir.parent / f"{job_dir.name}.err", "wb")
    return subprocess.Popen(command + [str(CHATTY), "--steps", "30", "--step-sleep", "0.05"], cwd=ROOT, env=env,
                            stdout=err, stderr=subprocess.STDOUT)


def wait_for(predicate, what, timeout=240):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("engine", ["framework", pytest.param("criu", marks=[
    pytest.mark.criu, pytest.mark.skipif(not CRIU_OK, reason=f"CRIU unavailable: {CRIU_DETAIL}")])])
def test_the_restored_attempts_log_starts_where_the_stopped_one_ended(engine, tmp_path):
    store, spool_root = tmp_path / "store", pathlib.Path("/tmp") / f"mer-logs-spool-{uuid.uuid4().hex[:6]}"
    first_dir, second_dir = tmp_path / "j" / "5.1", tmp_path / "j" / "5.2"
    first = launch(first_dir, engine=engine, store=store, spool_root=spool_root)
    try:
        wait_for(lambda: (first_dir / "control.sock").exists() or first.poll() is not None, "the control socket")
        JobControl(first_dir).stop(at_step=12, timeout_s=300)
        assert first.wait(timeout=120) == 75
        first_log = (first_dir / "logs" / "rank0.log").read_text()
        last = int(first_log.rstrip().splitlines()[-1].split()[1])
        assert last in (11, 12)  # the framework engine cuts inside step 12, before its print

        second = launch(second_dir, engine=engine, store=store, spool_root=spool_root, resume=True)
        assert second.wait(timeout=300) == 0, (second_dir.parent / "5.2.err").read_text()[-3000:]
    finally:
        for process in (first, locals().get("second")):
            if process is not None and process.poll() is None:
                process.kill()
        shutil.rmtree(spool_root, ignore_errors=True)
    manifest = read_manifest(second_dir)
    assert [(r.rank, r.stream) for r in manifest.ranks] == [(0, "stdout"), (0, "stderr")]
    second_log = pathlib.Path(manifest.ranks[0].path).read_text()
    if engine == "criu":  # the same file, carried: the old output, then the restored rank's
        assert manifest.ranks[0].start == len(first_log.encode()) and second_log.startswith(first_log)
    else:
        assert manifest.ranks[0].start == 0
    recorder = Recorder()
    shipper = LogShipper(tmp_path / "j", recorder)
    while shipper.ship_once():
        pass
    shipped = {attempt: "".join(c.text for c in recorder.chunks if c.attempt == attempt and c.stream == "stdout")
               for attempt in (1, 2)}
    assert shipped[1] == first_log
    steps = [int(line.split()[1]) for line in shipped[2].splitlines() if line.startswith("step ")]
    # On from the cut, none twice. A CRIU-restored rank goes on inside step 12 and prints it; a
    # framework restore resumes with the batch after the cut (what ran after step() in the cut
    # iteration is not run again: runtime/framework.py).
    assert steps == list(range(steps[0], 31)) and steps[0] == (last + 1 if engine == "criu" else 13), shipped[2][:500]
