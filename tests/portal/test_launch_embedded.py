"""`./meridian run`'s engine end to end: private Redis, migrate, seed, uvicorn, Celery
worker and beat; the portal answers; Ctrl-C stops every child and the private Redis."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_run_brings_up_the_portal_and_ctrl_c_stops_everything(tmp_path):
    import tempfile

    data_dir = Path(tempfile.mkdtemp(prefix="mr-run-"))  # short: it holds the Redis socket
    port = _free_port()
    # The embedded path: no DATABASE_URL or REDIS_URL, whatever the test run itself uses.
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "PORT"}}
    env["MERIDIAN_DATA_DIR"] = str(data_dir)
    process = subprocess.Popen(
        [sys.executable, "-m", "portal.launch", "run", "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    lines = []
    banner = threading.Event()

    def read():
        for line in process.stdout:
            lines.append(line)
            if "Press Ctrl-C to stop" in line:
                banner.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert banner.wait(timeout=180), "".join(lines[-40:])
        output = "".join(lines)
        assert f"Meridian is running at http://127.0.0.1:{port}/" in output
        assert "alice    alice-demo-pass" in output

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/accounts/login/", timeout=30) as response:
            assert response.status == 200
            assert b"Log in to Meridian" in response.read()
        assert (data_dir / "redis.sock").is_socket()
        assert (data_dir / "meridian.sqlite3").exists()
    finally:
        os.kill(process.pid, signal.SIGINT)
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
        reader.join(timeout=10)
    assert code == 0, "".join(lines[-40:])
    assert "[meridian] stopping" in "".join(lines)
    assert not (data_dir / "redis.sock").exists()
    # Every child ran in its own process group under the launcher; none may outlive it.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _children_alive(data_dir, port):
        time.sleep(0.2)
    assert not _children_alive(data_dir, port)
    subprocess.run(["rm", "-rf", str(data_dir)], check=False)


def _children_alive(data_dir, port):
    alive = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(data_dir) in cmdline or f"-p {port} " in cmdline or f"meridian-{port}@" in cmdline:
            alive.append(cmdline)
    return alive
