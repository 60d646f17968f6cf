"""The control interface of a running job: a unix socket in the job directory.

Protocol: one JSON object per connection, one line each way. Requests:
    {"cmd": "progress"}
    {"cmd": "checkpoint", "at_step": optional int, "timeout_s": optional float}
    {"cmd": "stop", "at_step": optional int, "timeout_s": optional float}   checkpoint, then exit
    {"cmd": "resize", "devices": int, "at_step": optional int, "timeout_s": optional float}
Every answer has "ok" (bool); on failure "error" says why in words a person can act on.
"""
import json
import os
import pathlib
import socket

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

    Each method sends one command and returns the launcher's JSON answer as a dict; it raises
    JobControlError when the answer has ok=false or the launcher is not running.
    """

    def __init__(self, job_dir, *, connect_timeout_s=5.0):
        self.job_dir = pathlib.Path(job_dir)
        self.connect_timeout_s = connect_timeout_s

    def _call(self, payload, timeout_s):
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
        if not answer.get("ok"):
            raise JobControlError(answer.get("error") or f"{payload['cmd']} failed: {answer}")
        return answer

    def progress(self):
        """Returns {"step", "steps_per_s", "engine", "devices", "device_map", "state", ...}."""
        return self._call({"cmd": "progress"}, 30)

    def checkpoint(self, *, at_step=None, timeout_s=600):
        """Checkpoints at a consistent cut and goes on; returns {"step", "checkpoint" (URI),
        "engine", "bytes", "seconds"}."""
        return self._call({"cmd": "checkpoint", "at_step": at_step, "timeout_s": timeout_s},
                          timeout_s + 30)

    def stop(self, *, at_step=None, timeout_s=600):
        """Checkpoints at a consistent cut, then the job exits (launcher exit code 75)."""
        return self._call({"cmd": "stop", "at_step": at_step, "timeout_s": timeout_s},
                          timeout_s + 30)

    def resize(self, devices, *, at_step=None, timeout_s=600):
        """Maps the W ranks onto `devices` devices (must divide W) at the next step boundary
        (or after step at_step); returns {"step", "devices", "device_map", "seconds"}."""
        return self._call({"cmd": "resize", "devices": int(devices), "at_step": at_step,
                           "timeout_s": timeout_s}, timeout_s + 30)

    def is_running(self):
        try:
            self.progress()
        except (JobControlError, OSError):
            return False
        return True


def serve(job_dir, handle, on_sent=None):
    """Accepts connections forever (run in a daemon thread); handle(request) -> answer dict.

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
                    request = json.loads(line)
                    answer = handle(request)
                except Exception as exc:  # noqa: BLE001 - every failure becomes an answer
                    answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                conn.sendall((json.dumps(answer) + "\n").encode())
            except OSError:
                pass
            finally:
                conn.close()
                if on_sent is not None:
                    on_sent(request, answer)
    return server, loop
