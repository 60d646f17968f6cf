"""The agent's side of live logs: cutting rank output into bounded chunks, the launcher's rank
logs that outlive the spool, and the backlog limit (the rank log is the disk buffer)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from agent.logs import SHIPPED, LogShipper, cut, utf8_boundary
from protocol import ProtocolError
from protocol.logs import MAX_BATCH_BYTES, MAX_CHUNK_BYTES, MAX_CHUNKS, LogBatchAnswer, LogChunk
from runtime.rank_logs import read_manifest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHATTY = pathlib.Path(__file__).with_name("chatty_train.py")
GRANT = "ab" * 32  # the copy's log grant, as its desired state named it (agent/node.py writes it to agent.json)


class Recorder:
    """The control plane's answer, kept: every batch is taken (what a real one does for a job
    placed on this node); the HTTP path is tested in test_log_api.py and test_agent_buffer.py."""

    def __init__(self):
        self.batches = []
        self.token = None

    def logs(self, batch):
        self.batches.append(batch)
        return LogBatchAnswer(stored=len(batch.chunks))

    @property
    def chunks(self):
        """The chunks with output."""
        return [c for b in self.batches for c in b.chunks if c.length]


@pytest.mark.parametrize("data, final, expected", [
    (b"a\nb\npartial", False, b"a\nb\n"),
    (b"partial", False, b""),
    (b"partial", True, b"partial"),
    (b"a\nb", True, b"a\nb"),
], ids=["up to the last line end", "a partial line waits", "a final partial line goes", "final: all of it"])
def test_cut_keeps_whole_lines_while_the_rank_writes(data, final, expected):
    assert cut(data, final=final) == expected


def test_a_full_read_without_a_line_end_is_cut_at_a_character_boundary():
    data = ("x" * (MAX_CHUNK_BYTES - 2)).encode() + "é€".encode()  # 2 + 3 bytes: the euro sign is cut
    piece = cut(data, final=False)
    assert len(piece) <= MAX_CHUNK_BYTES and piece.decode("utf-8").endswith("é")
    assert utf8_boundary("ab€".encode()[:-1]) == 2 and utf8_boundary("ab€".encode()) == 5


def test_a_chunk_is_bounded_at_the_protocol():
    fields = {"job_id": 1, "generation": 1, "attempt": 1, "rank": 0, "offset": 0, "length": 1}
    with pytest.raises(ProtocolError) as error:
        LogChunk.from_dict({**fields, "text": "x" * (MAX_CHUNK_BYTES + 1)})
    assert error.value.field == "text"
    with pytest.raises(ProtocolError) as error:
        LogChunk.from_dict({**fields, "text": "x", "rank": -1})
    assert error.value.field == "rank"


def test_a_copy_whose_launcher_is_being_started_is_not_taken_for_one_that_ended(tmp_path):
    # The agent writes agent.json without a pid, opens launcher.err for the launcher it is about to
    # start and writes the pid just after: in between, the chaos soak saw the shipper mark the new
    # copy done, so none of its output was ever shipped.
    job_dir = tmp_path / "j" / "7.1"
    job_dir.mkdir(parents=True)
    (job_dir / "launcher.err").write_bytes(b"")
    shipper = LogShipper(tmp_path / "j", Recorder())
    assert shipper.ship_once() == 0
    (job_dir / "agent.json").write_text(json.dumps({"pid": None, "generation": 3}))
    assert shipper.ship_once() == 0
    assert not shipper.sources[job_dir].done and not (job_dir / SHIPPED).exists()

    # The pid is written: a launcher that then ends before it names any rank log is done.
    ended = subprocess.Popen(["true"])
    ended.wait()  # reaped: its pid names no process
    (job_dir / "agent.json").write_text(json.dumps({"pid": ended.pid, "generation": 3}))
    assert shipper.ship_once() == 0
    assert json.loads((job_dir / SHIPPED).read_text())["done"] is True



def test_a_pid_recorded_while_the_shipper_looks_is_not_taken_for_a_launcher_that_ended(tmp_path):
    # The agent's main thread writes the launcher's pid while the shipper (another thread) is between
    # its reads: liveness taken without the pid (gone), then the pid found. The soak lost a copy's
    # whole output so. Here the pid is written exactly in that gap.
    job_dir = tmp_path / "j" / "7.1"
    job_dir.mkdir(parents=True)
    (job_dir / "launcher.err").write_bytes(b"")
    (job_dir / "agent.json").write_text(json.dumps({"pid": None, "generation": 3}))
    starting = subprocess.Popen(["sleep", "30"])

    def liveness_then_pid_written(folder):
        from agent.node import launcher_pid, pid_alive

        alive = pid_alive(launcher_pid(folder))  # no pid yet: reads as gone
        (folder / "agent.json").write_text(json.dumps({"pid": starting.pid, "generation": 3}))
        return alive

    try:
        shipper = LogShipper(tmp_path / "j", Recorder(), launcher_alive=liveness_then_pid_written)
        assert shipper.ship_once() == 0
        assert not shipper.sources[job_dir].done and not (job_dir / SHIPPED).exists()
    finally:
        starting.kill()
        starting.wait()

def run_launcher(tmp_path, *args, job="7.1", ranks=2, expect=0):
    job_dir = tmp_path / "j" / job
    env = {**os.environ, "MERIDIAN_SPOOL_ROOT": str(tmp_path / "spool"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT), "MERIDIAN_GENERATION": "3"}
    result = subprocess.run([sys.executable, "-m", "runtime.launcher", "--ranks", str(ranks), "--engine",
                             "framework", "--job-dir", str(job_dir), "--job-id", f"j{job}", str(CHATTY), *args],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == expect, result.stderr[-3000:]
    (job_dir / "agent.json").write_text(json.dumps({"generation": 3, "log_grant": GRANT}))
    return job_dir


@pytest.mark.runtime
def test_the_rank_logs_outlive_the_spool_and_ship_whole_in_bounded_contiguous_chunks(tmp_path):
    job_dir = run_launcher(tmp_path, "--steps", "40", "--step-sleep", "0")
    manifest = read_manifest(job_dir)
    assert [r.path for r in manifest.ranks] == [str(job_dir / "logs" / f"rank{r}.{kind}") for r in (0, 1)
                                                for kind in ("log", "err")]
    assert not (tmp_path / "spool" / "j7.1").exists()  # the spool is gone, the logs are not

    recorder = Recorder()
    shipper = LogShipper(tmp_path / "j", recorder)
    while shipper.ship_once():
        pass
    for rank in (0, 1):
        for stream, name in (("stdout", f"rank{rank}.log"), ("stderr", f"rank{rank}.err")):
            chunks = [c for c in recorder.chunks if c.rank == rank and c.stream == stream]
            expected = (job_dir / "logs" / name).read_bytes()
            assert "".join(c.text for c in chunks).encode() == expected
            assert [c.offset for c in chunks] == [sum(c.length for c in chunks[:i]) for i in range(len(chunks))]
        stdout, stderr = ((job_dir / "logs" / f"rank{rank}.{kind}").read_text() for kind in ("log", "err"))
        assert f"step 40 rank {rank}\n" in stdout and "step 40" not in stderr
    assert all(c.length <= MAX_CHUNK_BYTES and c.generation == 3 and c.attempt == 1 for c in recorder.chunks)
    assert {c.grant for b in recorder.batches for c in b.chunks} == {GRANT}  # every chunk
    assert {r.stream for r in manifest.ranks} == {"stdout", "stderr"}
    assert all(c.length for b in recorder.batches for c in b.chunks)  # nothing empty is sent
    assert all(len(b.chunks) <= MAX_CHUNKS and len(json.dumps(b.to_dict())) <= MAX_BATCH_BYTES + MAX_CHUNK_BYTES * 2
               for b in recorder.batches)
    # Done and remembered: a restarted agent sends nothing again.
    assert json.loads((job_dir / SHIPPED).read_text())["done"] is True
    again = Recorder()
    assert LogShipper(tmp_path / "j", again).ship_once() == 0 and again.batches == []


@pytest.mark.runtime
def test_a_restarted_shipper_carries_on_where_the_control_plane_stopped_acknowledging(tmp_path):
    job_dir = run_launcher(tmp_path, "--steps", "10", "--step-sleep", "0", ranks=1)
    first = Recorder()
    shipper = LogShipper(tmp_path / "j", first)
    shipper.ship_once()
    while shipper.ship_once():
        pass
    sent = sum(c.length for c in first.chunks if c.stream == "stdout")
    log = job_dir / "logs" / "rank0.log"
    with open(log, "a") as handle:  # more output after the agent went away
        handle.write("written while no agent ran\n")
    err_size = (job_dir / "logs" / "rank0.err").stat().st_size
    (job_dir / SHIPPED).write_text(json.dumps({"done": False,
                                               "sent": {"0:stdout": sent, "0:stderr": err_size}}))
    second = Recorder()
    restarted = LogShipper(tmp_path / "j", second)
    while restarted.ship_once():
        pass
    assert "".join(c.text for c in second.chunks) == "written while no agent ran\n"
    assert second.chunks[0].offset == sent


@pytest.mark.runtime
def test_beyond_the_backlog_limit_the_oldest_unsent_output_is_dropped_and_said(tmp_path):
    job_dir = run_launcher(tmp_path, "--steps", "2", "--step-sleep", "0", ranks=1)
    log = job_dir / "logs" / "rank0.log"
    with open(log, "a") as handle:
        for i in range(4000):
            handle.write(f"line {i:06d} {'y' * 40}\n")
    size, limit = log.stat().st_size, 32 * 1024
    recorder = Recorder()
    shipper = LogShipper(tmp_path / "j", recorder, backlog_limit=limit)
    while shipper.ship_once():
        pass
    chunks = [c for c in recorder.chunks if c.stream == "stdout"]
    assert chunks[0].dropped == size - limit and sum(c.dropped for c in chunks) == size - limit
    assert sum(c.length for c in chunks) == limit  # the newest `limit` bytes, all of them
    assert "".join(c.text for c in chunks).endswith("line 003999 " + "y" * 40 + "\n")


@pytest.mark.runtime
def test_stdout_and_stderr_ship_as_streams_of_their_own(tmp_path):
    job_dir = run_launcher(tmp_path, "--steps", "10", "--step-sleep", "0", "--fail-at", "3", ranks=1, expect=1)
    recorder = Recorder()
    shipper = LogShipper(tmp_path / "j", recorder)
    while shipper.ship_once():
        pass
    stdout = "".join(c.text for c in recorder.chunks if c.stream == "stdout")
    stderr = "".join(c.text for c in recorder.chunks if c.stream == "stderr")
    assert "step 3 rank 0" in stdout and "ValueError" not in stdout
    assert "ValueError: rank 0 gives up at step 3" in stderr and "step 3 rank 0" not in stderr
    assert stderr.encode() == (job_dir / "logs" / "rank0.err").read_bytes()
