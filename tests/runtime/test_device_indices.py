"""--device-indices: checked against --devices, recorded (progress, events, checkpoint meta), passed to
the ranks as MERIDIAN_DEVICE_INDICES, and replaced by the indices a resize request carries."""
import json
import socket
import subprocess
import sys

import pytest
from runtime_helpers import ROOT, SCRIPTS, Job, needs_criu, unique_id

from runtime import launcher
from runtime.control import JobControlError, read_line, socket_path
from runtime.store import CheckpointStore

pytestmark = pytest.mark.runtime
SCRIPT = SCRIPTS / "device_indices_log.py"


def _launch(tmp_path, *args):
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    return subprocess.run([sys.executable, "-m", "runtime.launcher", "--ranks", "4", *args,
                           "--job-dir", str(tmp_path / "job"), str(script)],
                          capture_output=True, text=True, cwd=ROOT)


@pytest.mark.parametrize("args, words", [
    (["--devices", "2", "--device-indices", "0,2,5"], "--device-indices lists 3 device(s) (0,2,5) but --devices is 2"),
    (["--device-indices", "1,1"], "names a device twice"),
    (["--device-indices", "0,x"], "is not a comma-separated list of device indices"),
    (["--device-indices", "0,-1"], "non-negative"),
], ids=["count-mismatch", "duplicate", "not-a-number", "negative"])
def test_it_refuses_device_indices_that_do_not_describe_the_devices(tmp_path, args, words):
    result = _launch(tmp_path, *args)
    assert result.returncode == launcher.EXIT_USAGE
    assert words in result.stderr


def test_parse_device_indices_gives_the_indices_in_order():
    assert launcher.parse_device_indices("5,0,2") == (5, 0, 2)


def _raw_call(job_dir, payload):
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(socket_path(job_dir)))
    try:
        conn.sendall((json.dumps(payload) + "\n").encode())
        return json.loads(read_line(conn))
    finally:
        conn.close()


def _rank_environ(pid):
    with open(f"/proc/{pid}/environ", "rb") as handle:
        pairs = [item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item]
    return {key.decode(): value.decode() for key, value in pairs}


def test_device_indices_are_recorded_passed_to_the_ranks_and_replaced_by_a_resize(tmp_path, jobs):
    out = tmp_path / "out.pt"
    node = tmp_path / "node"
    job = Job(node, ranks=2, script=SCRIPT, out=out, engine="framework", device_indices=(3, 5),
              job_id=unique_id("indices"))
    jobs.append(job)
    job.wait_ready()
    progress = job.wait_step(2)
    assert progress["devices"] == 2 and progress["device_indices"] == [3, 5]
    assert [_rank_environ(pid)["MERIDIAN_DEVICE_INDICES"] for pid in progress["rank_pids"]] == ["3,5", "3,5"]

    refused = _raw_call(node, {"cmd": "resize", "devices": 1, "device_indices": [4, 6]})
    assert refused["ok"] is False and "device_indices" in refused["error"]
    with pytest.raises(JobControlError, match="device_indices"):
        job.control.resize(1, device_indices=[4, 6])

    resized = job.control.resize(1, device_indices=[4])
    assert resized["devices"] == 1 and resized["device_indices"] == [4]
    assert job.control.progress()["device_indices"] == [4]
    checkpoint = job.control.checkpoint()
    job.finish(0)

    events = [json.loads(line) for line in (node / "events.jsonl").read_text().splitlines()]
    assert [e["device_indices"] for e in events if e["event"] in ("started", "resize")] == [[3, 5], [4]]
    store = CheckpointStore(node / "checkpoints")
    ref = next(ref for ref in store.list() if ref.uri == checkpoint["checkpoint"])
    assert store.verify(ref)["meta"]["device_indices"] == [4]
    for rank in (0, 1):
        assert (tmp_path / f"out.pt.rank{rank}.indices").read_text().splitlines() == ["3,5", "4"]


@pytest.mark.criu
@needs_criu
def test_ranks_restored_by_criu_see_the_indices_of_their_new_launcher(tmp_path, jobs):
    """A CRIU rank keeps its environment through a dump; the resume file carries the new launcher's
    indices, and the rank takes them before its next step."""
    out = tmp_path / "out.pt"
    node = tmp_path / "node"
    first = Job(node, ranks=2, script=SCRIPT, out=out, engine="criu", device_indices=(3, 5),
                job_id=unique_id("indices-criu"))
    jobs.append(first)
    first.wait_ready()
    first.wait_step(3)
    stopped = first.control.stop()
    first.finish(launcher.EXIT_STOPPED)

    second = Job(node, ranks=2, script=SCRIPT, out=out, engine="criu", device_indices=(1, 2),
                 job_id=unique_id("indices-criu"), resume=True)
    jobs.append(second)
    second.finish(0)
    events = [json.loads(line) for line in (node / "events.jsonl").read_text().splitlines()]
    restored = [e for e in events if e["event"] == "restored"]
    assert restored[0]["device_indices"] == [1, 2] and restored[0]["checkpoint"] == stopped["checkpoint"]
    for rank in (0, 1):
        assert (tmp_path / f"out.pt.rank{rank}.indices").read_text().splitlines() == ["3,5", "1,2"]
