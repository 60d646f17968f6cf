"""Control-interface errors, engine choice and the GPU path's refusal, without rank processes."""
import json
import subprocess
import sys

import pytest

from protocol.cut import DeviceMap
from protocol.launch import ControlFailure, Progress, ProgressRequest, ResizeRequest
from runtime import criu, cuda_checkpoint, launcher
from runtime.control import JobControl, JobControlError, read_line, serve, socket_path

pytestmark = pytest.mark.runtime


def test_job_control_without_a_launcher_says_so(tmp_path):
    with pytest.raises(JobControlError, match="no launcher is listening"):
        JobControl(tmp_path).progress()


def test_a_job_dir_too_long_for_a_unix_socket_is_refused(tmp_path):
    with pytest.raises(ValueError, match="longer than 107 bytes"):
        socket_path(tmp_path / ("x" * 120))


def test_auto_engine_names_its_choice_and_reason():
    engine, reason = launcher.choose_engine("auto")
    ok, detail = criu.check_available()
    assert engine == ("criu" if ok else "framework")
    assert reason.startswith("auto:") and detail in reason


def test_requested_criu_never_falls_back_silently(monkeypatch):
    monkeypatch.setattr(criu, "check_available", lambda: (False, "criu is not installed"))
    with pytest.raises(launcher.LaunchError, match="CRIU is unavailable: criu is not installed"):
        launcher.choose_engine("criu")
    assert launcher.choose_engine("auto") == ("framework", "auto: CRIU unusable (criu is not installed)")


def test_launcher_rejects_devices_that_do_not_divide_ranks(tmp_path):
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    result = subprocess.run([sys.executable, "-m", "runtime.launcher", "--ranks", "4",
                             "--devices", "3", "--job-dir", str(tmp_path / "job"), str(script)],
                            capture_output=True, text=True, cwd=launcher.__file__.rsplit("/runtime/", 1)[0])
    assert result.returncode == launcher.EXIT_USAGE
    assert "3 devices do not divide the world size 4" in result.stderr


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path):
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    result = subprocess.run([sys.executable, "-m", "runtime.launcher", "--ranks", "1",
                             "--job-dir", str(tmp_path / "job"), "--resume", str(script)],
                            capture_output=True, text=True, cwd=launcher.__file__.rsplit("/runtime/", 1)[0])
    assert result.returncode == launcher.EXIT_USAGE
    assert "no usable checkpoint" in result.stderr


def _has_nvidia_driver():
    try:
        cuda_checkpoint.load_driver()
    except cuda_checkpoint.CudaCheckpointUnavailable:
        return False
    return True


@pytest.mark.skipif(_has_nvidia_driver(), reason="an NVIDIA driver is present: no refusal to test")
def test_cuda_checkpoint_refuses_clearly_without_a_gpu():
    with pytest.raises(cuda_checkpoint.CudaCheckpointUnavailable, match="driver >= 570"):
        cuda_checkpoint.CudaProcessCheckpoint(1)


def _serve(job_dir, handle):
    import threading
    server, loop = serve(job_dir, handle)
    threading.Thread(target=loop, daemon=True).start()
    return server


def _raw(job_dir, line):
    import socket
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(socket_path(job_dir)))
    try:
        conn.sendall(line.encode() + b"\n")
        return json.loads(read_line(conn))
    finally:
        conn.close()


def test_the_control_socket_hands_typed_requests_over_and_refuses_malformed_ones_itself(tmp_path):
    seen = []
    device_map = DeviceMap.from_dict({"devices": {"0": [0]}, "ranks": {"0": 0}})

    def handle(request):
        seen.append(request)
        if isinstance(request, ProgressRequest):
            return Progress(job_id="j", state="running", step=3, world_size=1, devices=1, device_map=device_map,
                            updated_unix=1.0, spool="/s")
        return ControlFailure(error="no cut today")

    server = _serve(tmp_path, handle)
    try:
        assert JobControl(tmp_path).progress()["step"] == 3
        with pytest.raises(JobControlError, match="no cut today"):
            JobControl(tmp_path).resize(1, device_indices=[2])
        assert seen == [ProgressRequest(), ResizeRequest(devices=1, device_indices=(2,), timeout_s=600)]
        for line, field in [('{"cmd": "explode"}', "cmd"), ('{"cmd": "resize", "devices": 0}', "devices"),
                            ('{"cmd": "stop", "at_step": "soon"}', "at_step")]:
            answer = _raw(tmp_path, line)
            assert answer["ok"] is False and f"bad control request: {field}:" in answer["error"]
        assert len(seen) == 2
    finally:
        server.close()


def test_a_client_refuses_indices_that_do_not_match_the_device_count_before_sending(tmp_path):
    with pytest.raises(JobControlError, match="device_indices: lists 2 device"):
        JobControl(tmp_path).resize(1, device_indices=[0, 1])
