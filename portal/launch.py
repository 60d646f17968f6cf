"""Runs Meridian embedded, or its tests, from one command (the `./meridian` script).

    python -m portal.launch run [--demo-workload] [--port N] [--synthetic-fleet]
    python -m portal.launch test [pytest args...]

`run` starts a private Redis (unless REDIS_URL is set), migrates, seeds the demo fleet
and users, then supervises the ASGI web server (uvicorn, portal/web_server.py), a Celery worker
and Celery beat, and the demo fleet's node agents (agent/embedded.py); Ctrl-C (or SIGTERM) stops
everything, children first.

No Django import at module level: this process only supervises; Django runs in the
children (manage.py, uvicorn, celery).
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from agent.embedded import embedded_env_defaults, embedded_processes
from portal.private_redis import PrivateRedis, PrivateRedisError
from portal.web_server import web_server_argv

ROOT = Path(__file__).resolve().parent.parent
DEMO_LOGINS = (
    ("alice", "alice-demo-pass", "member of Team A: submits jobs"),
    ("bob", "bob-demo-pass", "member of Team A"),
    ("charlie", "charlie-demo-pass", "member of Team B: sees nothing of Team A's"),
    ("carol", "carol-demo-pass", "capacity manager of Teams A and B: approves preemptions"),
    ("admin", "admin-demo-pass", "global admin (also /admin/)"),
)
STOP_TIMEOUT = 15.0


@dataclass
class ProcessSpec:
    """One supervised child. `ready_url` (optional) is polled before the banner prints."""

    name: str
    argv: list
    env: dict = field(default_factory=dict)
    cwd: Path = ROOT


@dataclass
class LaunchContext:
    root: Path
    python: str
    data_dir: Path
    url: str
    env: dict
    demo_workload: int | None  # None: no demo workload; 0: endless; N: N jobs

    def manage(self, *args):
        """Runs `manage.py args` with the run's environment; returns its stdout or raises."""
        result = subprocess.run(
            [self.python, str(self.root / "manage.py"), *args],
            env=self.env, cwd=self.root, capture_output=True, text=True,
        )
        if result.returncode != 0:
            raise LaunchError(f"manage.py {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
        return result.stdout


class LaunchError(RuntimeError):
    pass


class Supervisor:
    """Starts children in their own process groups, prefixes their output, stops them all."""

    def __init__(self):
        self.children = []  # (spec, Popen)
        self.stopping = threading.Event()

    def start(self, spec, base_env):
        env = {**base_env, **spec.env}
        process = subprocess.Popen(
            spec.argv, cwd=spec.cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, text=True, bufsize=1,
        )
        threading.Thread(target=self._pump, args=(spec.name, process), daemon=True).start()
        self.children.append((spec, process))
        return process

    @staticmethod
    def _pump(name, process):
        for line in process.stdout:
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()

    def first_exited(self):
        for spec, process in self.children:
            if process.poll() is not None:
                return spec, process.returncode
        return None

    def stop_all(self):
        self.stopping.set()
        for _, process in reversed(self.children):
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STOP_TIMEOUT
        for spec, process in reversed(self.children):
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"[meridian] {spec.name} did not stop in {STOP_TIMEOUT:.0f} s; killing it", flush=True)
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()


def _port_is_free(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait_for_port(port, *, process, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.1)
    return False


def _base_env(data_dir):
    env = dict(os.environ)
    env["MERIDIAN_DATA_DIR"] = str(data_dir)
    env["DJANGO_SETTINGS_MODULE"] = "portal.settings"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _demo_jobs(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--demo-workload=N wants a whole number of jobs, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("--demo-workload=N wants at least 1 job (leave =N out for no bound)")
    return value


def _bin(name):
    return str(Path(sys.executable).parent / name)


def run(args):
    data_dir = Path(os.environ.get("MERIDIAN_DATA_DIR") or ROOT / "data").resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    port = args.port or int(os.environ.get("PORT", "8000"))
    if not _port_is_free(port):
        raise LaunchError(f"port {port} on 127.0.0.1 is in use; choose another: PORT={port + 1} ./meridian run")
    env = _base_env(data_dir)
    redis = None
    supervisor = Supervisor()
    stop_requested = threading.Event()

    def on_signal(signum, frame):
        stop_requested.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        if not os.environ.get("REDIS_URL"):
            redis = PrivateRedis(data_dir / "redis.sock").start()
            env["REDIS_URL"] = redis.url
            print(f"[meridian] private Redis on {redis.socket_path}", flush=True)
        context = LaunchContext(
            root=ROOT, python=sys.executable, data_dir=data_dir, url=f"http://127.0.0.1:{port}",
            env=env, demo_workload=args.demo_workload,
        )
        print("[meridian] migrating the database", flush=True)
        context.manage("migrate", "--noinput", "-v", "0")
        seed_args = ["demo_seed"] + (["--synthetic-fleet"] if args.synthetic_fleet else [])
        print("[meridian] " + context.manage(*seed_args).strip().replace("\n", "\n[meridian] "), flush=True)

        specs = [
            ProcessSpec("web", web_server_argv(bin_dir=Path(sys.executable).parent, port=port)),
            ProcessSpec("worker", [_bin("celery"), "-A", "portal", "worker", "--loglevel", "INFO",
                                   "--concurrency", "2", "--hostname", f"meridian-{port}@%h"]),
            ProcessSpec("beat", [_bin("celery"), "-A", "portal", "beat", "--loglevel", "INFO",
                                 "--schedule", str(data_dir / "celerybeat-schedule")]),
        ]
        # Set only now (as before): migrate and demo_seed never needed them.
        for name, value in embedded_env_defaults(data_dir=data_dir).items():
            env.setdefault(name, value)
        specs += [ProcessSpec(process.name, process.argv, env=process.env) for process in embedded_processes(
            python=context.python, url=context.url, root=context.root, data_dir=data_dir,
            enrollment_token=env["MERIDIAN_AGENT_ENROLLMENT_TOKEN"], demo_workload=args.demo_workload)]
        # The web server first: the agents register with it as they start (on a loaded machine
        # the web server took seconds to listen, and agents started beside it gave up).
        supervisor.start(specs[0], env)
        if not _wait_for_port(port, process=supervisor.children[0][1], timeout=180):
            raise LaunchError("the web server did not start; see the [web] lines above")
        for spec in specs[1:]:
            supervisor.start(spec, env)
        _print_banner(context.url)
        while not stop_requested.is_set():
            exited = supervisor.first_exited()
            if exited:
                spec, code = exited
                raise LaunchError(f"{spec.name} exited with code {code}; stopping everything")
            stop_requested.wait(0.5)
        print("\n[meridian] stopping", flush=True)
        return 0
    finally:
        supervisor.stop_all()
        if redis is not None:
            redis.stop()


def _print_banner(url):
    lines = [
        "",
        f"  Meridian is running at {url}/",
        f"  API docs: {url}/api/docs/   admin: {url}/admin/",
        "  Demo logins (local demo only):",
        *[f"    {user:<8} {password:<18} {role}" for user, password, role in DEMO_LOGINS],
        "  Press Ctrl-C to stop.",
        "",
    ]
    print("\n".join(lines), flush=True)


def test(pytest_args):
    """Runs pytest with a private Redis (unless REDIS_URL is set) and a throwaway data dir.

    With no arguments (the whole suite) and neither REDIS_URL nor DATABASE_URL set, in lanes at
    once (_test_lanes): MERIDIAN_TEST_LANES=3 (the default) heavy, hosts, and light then ranks; 2 puts
    the hosts lane's tests back in the heavy lane; 1 runs the suite in one process."""
    lanes = os.environ.get("MERIDIAN_TEST_LANES", "3")
    if not pytest_args and not os.environ.get("REDIS_URL") and not os.environ.get("DATABASE_URL") and lanes != "1":
        return _test_lanes(merge_hosts=lanes == "2")
    return _pytest_run(pytest_args, output=None)


def _pytest_run(pytest_args, *, output):
    """Runs pytest once with its own private Redis (unless REDIS_URL is set) and data dir; its
    output goes to `output` (a file) or to this process's. Returns pytest's exit code."""
    env = dict(os.environ)
    scratch = Path(tempfile.mkdtemp(prefix="meridian-test-"))
    env.setdefault("MERIDIAN_DATA_DIR", str(scratch / "data"))
    redis = None
    try:
        if not env.get("REDIS_URL"):
            redis = PrivateRedis(scratch / "redis.sock").start()
            env["REDIS_URL"] = redis.url
        print(f"[meridian] tests {' '.join(pytest_args)} with REDIS_URL={env['REDIS_URL']} "
              f"DATABASE_URL={env.get('DATABASE_URL', '(SQLite in memory)')}", flush=True)
        return subprocess.run([sys.executable, "-m", "pytest", *pytest_args], cwd=ROOT, env=env,
                              stdout=output, stderr=subprocess.STDOUT if output else None).returncode
    finally:
        if redis is not None:
            redis.stop()
        subprocess.run(["rm", "-rf", str(scratch)], check=False)


def _test_lanes(*, merge_hosts: bool):
    """The whole suite in pytest processes at once (tests/conftest.py lane_of), three streams: the
    heavy lane (agents, sandboxes, e2e stacks, browsers; one test at a time among themselves, as
    they share the node's /tmp, /dev/shm and cgroups) printed as it runs; beside it the hosts lane
    (the emulated hosts, one at a time), and the light lane (in-process tests) followed by the ranks
    lane (the runtime's launchers and ranks), each printed whole when it ends. Why: the process lanes
    are ~95% of the suite's time and mostly wait on their processes; one after the other they leave
    a core idle. Each lane has its own Redis, data dir and (SQLite in memory) database.
    `merge_hosts`: the emulated hosts in the heavy lane."""
    streams = ([] if merge_hosts else [("hosts",)]) + [("light", "ranks")]
    beside = [lane for stream in streams for lane in stream]
    print(f"[meridian] the whole suite in lanes, {1 + len(streams)} at once: heavy (printed as it runs), "
          f"{'; '.join(' then '.join(stream) for stream in streams)} (printed when each ends); "
          f"MERIDIAN_TEST_LANES=1 runs one process", flush=True)
    codes, outputs, threads = {}, {}, []

    def run_stream(stream):
        for lane in stream:
            codes[lane] = _pytest_run(["--lane", lane], output=outputs[lane])

    for lane in beside:
        outputs[lane] = tempfile.TemporaryFile(mode="w+")
    for stream in streams:
        threads.append(threading.Thread(target=run_stream, args=(stream,)))
        threads[-1].start()
    heavy = ["--lane", "heavy"] + (["--lane", "hosts"] if merge_hosts else [])
    codes["heavy"] = _pytest_run(heavy, output=None)
    for thread in threads:
        thread.join()
    for lane in beside:
        outputs[lane].seek(0)
        print(f"\n[meridian] ===== the {lane} lane's output =====", flush=True)
        sys.stdout.write(outputs[lane].read())
        outputs[lane].close()
    for lane in ("heavy", *beside):
        print(f"[meridian] {lane} lane: {'passed' if codes[lane] == 0 else f'FAILED (pytest exit {codes[lane]})'}",
              flush=True)
    return next((code for code in codes.values() if code != 0), 0)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["test"]:
        # Everything after "test" goes to pytest untouched (argparse would eat "-m", "-k"...).
        return test(argv[1:])
    parser = argparse.ArgumentParser(prog="meridian")
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run Meridian embedded")
    run_parser.add_argument("--demo-workload", nargs="?", type=_demo_jobs, const=0, default=None, metavar="N",
                            help="keep a steady seeded stream of small real training jobs of every tier, shipped "
                                 "as code bundles (=N: stop after N jobs)")
    run_parser.add_argument("--port", type=int, default=None, help="HTTP port on 127.0.0.1 (default $PORT or 8000)")
    run_parser.add_argument("--synthetic-fleet", action="store_true",
                            help="also seed a synthetic 2,048-GPU fleet (no agents) for the heatmap")
    commands.add_parser("test", help="run the test suite (arguments go to pytest)")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (LaunchError, PrivateRedisError) as error:
        print(f"[meridian] error: {error}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
