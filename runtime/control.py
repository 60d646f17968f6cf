"""The control interface of a running job: a unix socket in the job directory.

Protocol: one JSON object per connection, one line each way; the messages are protocol.launch's:
    ProgressRequest    {"cmd": "progress"}                                       -> Progress
    CheckpointRequest  {"cmd": "checkpoint", "at_step"?, "timeout_s"?}           -> CheckpointAnswer
    StopRequest        {"cmd": "stop", "at_step"?, "timeout_s"?}  checkpoint, then exit
    ResizeRequest      {"cmd": "resize", "devices", "device_indices"?, "at_step"?, "timeout_s"?}
Every answer has "ok" (bool); on failure (ControlFailure) "error" says why in words a person can act on.
"""
from __future__ import annotations

import json
import os
import pathlib
import socket
from typing import Any, Callable

from protocol import Message, ProtocolError
from protocol.launch import (
    CheckpointRequest,
    ControlFailure,
    ControlRequest,
    ProgressRequest,
    ResizeRequest,
    StopRequest,
    control_answer_from_dict,
    control_request_from_dict,
)

SOCKET_NAME = "control.sock"
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the terminating NUL


class JobControlError(RuntimeError):
    """The launcher answered a command with ok=false (message included) or is not reachable."""


def socket_path(job_dir):
    path = pathlib.Path(job_dir).absolute() / SOCKET_NAME
    if len(str(path).encode()) > MAX_SOCKET_PATH:
        raise ValueError(f"control socket path {path} is longer than {MAX_SOCKET_PATH} bytes "
                         "(a unix socket limit); use a shorter --job-dir")
    return path


def read_line(conn):
    chunks = []
    while True:
        chunk = conn.recv(65536)
        if not chunk:
            break
        chunks.append(chunk)
        if chunk.endswith(b"\n"):
            break
    return b"".join(chunks).decode()


class JobControl:
    """The agent's handle on one job, addressed by its job directory.

    Each method sends one typed command and returns the launcher's answer as its wire dict, once
    it decoded as that command's answer type (protocol.launch); it raises JobControlError when the
    answer has ok=false, does not decode, or the launcher is not running.
    """

    def __init__(self, job_dir, *, connect_timeout_s=5.0):
        self.job_dir = pathlib.Path(job_dir)
        self.connect_timeout_s = connect_timeout_s

    def _call(self, request: ControlRequest, timeout_s: float) -> dict[str, Any]:
        payload = request.to_dict()
        path = socket_path(self.job_dir)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(self.connect_timeout_s)
        try:
            try:
                conn.connect(str(path))
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                raise JobControlError(f"no launcher is listening at {path} ({exc})") from None
            conn.settimeout(timeout_s)
            conn.sendall((json.dumps(payload) + "\n").encode())
            line = read_line(conn)
        finally:
            conn.close()
        if not line:
            raise JobControlError(f"launcher at {path} closed the connection without answering "
                                  f"{payload['cmd']!r}")
        answer = json.loads(line)
        try:
            typed = control_answer_from_dict(request.cmd, answer)
        except ProtocolError as exc:
            raise JobControlError(f"launcher at {path} answered {request.cmd!r} with a malformed "
                                  f"message ({exc}): {line[:500]}") from None
        if isinstance(typed, ControlFailure):
            raise JobControlError(typed.error or f"{request.cmd} failed: {answer}")
        return answer

    def progress(self):
        """Returns {"step", "steps_per_s", "engine", "devices", "device_map", "state", ...}."""
        return self._call(ProgressRequest(), 30)

    def checkpoint(self, *, at_step=None, timeout_s=600):
        """Checkpoints at a consistent cut and goes on; returns {"step", "checkpoint" (URI),
        "engine", "bytes", "seconds"}."""
        return self._call(CheckpointRequest(at_step=at_step, timeout_s=timeout_s), timeout_s + 30)

    def stop(self, *, at_step=None, timeout_s=600):
        """Checkpoints at a consistent cut, then the job exits (launcher exit code 75)."""
        return self._call(StopRequest(at_step=at_step, timeout_s=timeout_s), timeout_s + 30)

    def resize(self, devices, *, device_indices=None, at_step=None, timeout_s=600):
        """Maps the W ranks onto `devices` devices (must divide W) at the next step boundary
        (or after step at_step); `device_indices`, when given, are the node-local indices of those
        devices (as many as `devices`; recorded by the launcher and passed to the ranks). Returns
        {"step", "devices", "device_map", "device_indices", "seconds"}."""
        indices = None if device_indices is None else tuple(int(index) for index in device_indices)
        try:
            request = ResizeRequest(devices=int(devices), device_indices=indices, at_step=at_step,
                                    timeout_s=timeout_s)
        except ProtocolError as exc:
            raise JobControlError(f"resize: {exc}") from None
        return self._call(request, timeout_s + 30)

    def is_running(self):
        try:
            self.progress()
        except (JobControlError, OSError):
            return False
        return True


def serve(job_dir, handle: Callable[[ControlRequest], Message],
          on_sent: Callable[[ControlRequest | None, Message | None], None] | None = None):
    """Accepts connections forever (run in a daemon thread); handle(request) -> answer message.
    A request that does not decode is answered with a ControlFailure naming its bad field, and
    never reaches `handle`.

    on_sent(request, answer), when given, is called once the answer was written (or could not
    be): a launcher about to exit waits for it, so its last answer is not lost."""
    path = socket_path(job_dir)
    if path.exists():
        path.unlink()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    os.chmod(path, 0o600)
    server.listen(8)

    def loop():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # the launcher closed the socket: it is exiting
                return
            request, answer = None, None
            try:
                line = read_line(conn)
                try:
                    request = control_request_from_dict(json.loads(line))
                    answer = handle(request)
                except ProtocolError as exc:
                    answer = ControlFailure(error=f"bad control request: {exc}")
                except Exception as exc:  # noqa: BLE001 - every failure becomes an answer
                    answer = ControlFailure(error=f"{type(exc).__name__}: {exc}")
                conn.sendall((json.dumps(answer.to_dict()) + "\n").encode())
            except OSError:
                pass
            finally:
                conn.close()
                if on_sent is not None:
                    on_sent(request, answer)
    return server, loop
