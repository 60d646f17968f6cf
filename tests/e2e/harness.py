"""The end-to-end stack, for real: a private Redis, the ASGI web server (portal.web_server: uvicorn),
a Celery worker and Celery beat, node agents (agent.main) that run jobs through the real runtime (meridian-run,
framework engine). Talks to it only through the HTTP API, as users and agents do.

Everything lives in one temp dir (SQLite file, Redis socket, agents' work dirs, the checkpoint
store, training outputs) and is torn down by `ControlPlane.stop()`, which also kills (by pid)
any launcher or rank process an agent left behind.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import requests
from polling import poll

from portal.web_server import web_server_argv

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYTHON = sys.executable
BIN = pathlib.Path(sys.executable).parent
ENROLL = "e2e-enrollment-token"
TRAIN = "examples/train_mlp.py"
PASSWORDS = {"alice": "alice-demo-pass", "carol": "carol-demo-pass", "admin": "admin-demo-pass"}
FINAL_STATES = {"succeeded", "failed", "cancelled"}  # jobs.models.Job.TERMINAL_STATES (no Django here)
# A node silent this long is lost (its jobs restart elsewhere). Short, so the node-loss tests are
# quick, but not so short that a beat late under CI's load loses a node: at 8 s, a lone Basic job
# was once requeued in CI (its only node taken for lost) while the test expected no preemption.
LOST_AFTER_S = 15
ENGINE = "framework"  # explicit: the e2e tests exercise the framework checkpoint engine unless they ask for CRIU


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Partition:
    """A TCP forwarder to the control plane that a test can cut: a network partition (the agent
    and its jobs run on; nothing gets through, new connections are closed).

    Partition(port) forwards to one port; Partition(targets=callable) to the first live port of
    what the callable returns, round robin (a balancer over web processes: a dead one is skipped
    after `connect_timeout`). `bind`: the address it listens on (the emulated hosts' bridge address,
    for a balancer the hosts reach; the targets are always on loopback)."""

    def __init__(self, target_port=None, *, targets=None, connect_timeout=5.0, bind="127.0.0.1"):
        self.targets = targets or (lambda: [target_port])
        self.connect_timeout = connect_timeout
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind((bind, 0))
        self.server.listen(128)
        self.port = self.server.getsockname()[1]
        self.is_cut = threading.Event()
        self.lock = threading.Lock()
        self.connections = set()
        self.turn = 0
        threading.Thread(target=self._accept, daemon=True, name="partition").start()

    def _upstream(self):
        ports = list(self.targets())
        for offset in range(len(ports)):
            port = ports[(self.turn + offset) % len(ports)]
            try:
                connection = socket.create_connection(("127.0.0.1", port), timeout=self.connect_timeout)
            except OSError:
                continue
            connection.settimeout(None)
            self.turn += 1
            return connection
        return None

    def _accept(self):
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if self.is_cut.is_set():
                client.close()
                continue
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client):
        upstream = self._upstream()
        if upstream is None or self.is_cut.is_set():
            client.close()
            if upstream:
                upstream.close()
            return
        with self.lock:
            self.connections |= {client, upstream}
        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source, sink):
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self.lock:
                for end in (source, sink):
                    if end in self.connections:
                        self.connections.discard(end)
                        end.close()

    def cut(self):
        self.is_cut.set()
        with self.lock:
            for connection in self.connections:
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                connection.close()
            self.connections.clear()

    def heal(self):
        self.is_cut.clear()

    def close(self):
        self.cut()
        self.server.close()


class ControlPlane:
    def __init__(self, base_dir, *, env=None, bind="127.0.0.1"):
        self.dir = pathlib.Path(base_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.bind = bind  # the web server's address: the emulated hosts' bridge address (tests/hosts) or loopback
        self.url = f"http://{bind}:{self.port}"
        self.processes = {}
        self.agents = {}
        self.partitions = {}
        self.redis = None
        self.env = dict(os.environ)
        self.env.update({
            "MERIDIAN_DATA_DIR": str(self.dir / "data"),
            "DATABASE_URL": f"sqlite:///{self.dir / 'data' / 'db.sqlite3'}",
            "DJANGO_SETTINGS_MODULE": "portal.settings",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
            "MERIDIAN_AGENT_ENROLLMENT_TOKEN": ENROLL,
            "MERIDIAN_TICK_SECONDS": "1",
            "MERIDIAN_AGENT_HEARTBEAT_SECONDS": "1",
            # agents lease every second and send a full heartbeat every 3 s or on a change; the leases
            # reach Node.last_heartbeat every 2 s (fleet/leases.py)
            "MERIDIAN_AGENT_FULL_HEARTBEAT_SECONDS": "3",
            "MERIDIAN_LEASE_FLUSH_SECONDS": "2",
            "MERIDIAN_MIN_RUN_SECONDS": "0",
            "MERIDIAN_MIN_RESIZE_INTERVAL_SECONDS": "0",  # the elastic test grows back within a minute
            "MERIDIAN_ACCOUNTING_SECONDS": "0",
            "MERIDIAN_NODE_LOST_AFTER_SECONDS": str(LOST_AFTER_S),
            "MERIDIAN_WORKFLOW_TIMEOUT_SECONDS": "120",
            "MERIDIAN_CHECKPOINT_STORE": str(self.dir / "store"),
            "MERIDIAN_LOG_LEVEL": "INFO",
            "OMP_NUM_THREADS": "1",
        })
        self.env.pop("MERIDIAN_PROFILE", None)
        self.env.update(env or {})
        self.tokens = {}

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self, *, template_db=None):
        (self.dir / "data").mkdir(parents=True, exist_ok=True)
        if not self.env.get("REDIS_URL"):
            from portal.private_redis import PrivateRedis

            self.redis = PrivateRedis(self.dir / "redis.sock").start()
            self.env["REDIS_URL"] = self.redis.url
        db = self.dir / "data" / "db.sqlite3"
        if template_db:
            shutil.copyfile(template_db, db)
        else:
            prepare_database(self.env)
        self._spawn("web", web_server_argv(bin_dir=BIN, bind=self.bind, port=self.port))
        self._spawn("worker", [str(BIN / "celery"), "-A", "portal", "worker", "--loglevel", "INFO", "--pool", "solo",
                               "--hostname", f"e2e-{self.port}@%h"])
        self._spawn("beat", [str(BIN / "celery"), "-A", "portal", "beat", "--loglevel", "INFO",
                             "--schedule", str(self.dir / "data" / "beat-schedule")])
        poll("the web server", self._answers, timeout=90, on_timeout=self.logs)
        return self

    def _answers(self):
        try:
            return requests.get(f"{self.url}/api/schema/", timeout=5).status_code < 500 or True
        except requests.RequestException:
            return False

    def _spawn(self, name, argv, *, env=None):
        log = open(self.dir / f"{name}.log", "ab")
        process = subprocess.Popen(argv, cwd=ROOT, env={**self.env, **(env or {})}, stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.processes[name] = process
        return process

    def start_agent(self, hostname, *, devices=1, region="r1", cluster="c1", checkpoint_every=3.0,
                    partitionable=False, engine=ENGINE, sandbox="off", extra=()):
        """Starts an agent; returns its process (its work dir is self.agents[hostname][1]).
        partitionable=True puts a Partition between it and the control plane (self.partitions[hostname]).

        sandbox="off" (the default) runs jobs as the agent's user: most e2e tests write outputs where
        the test reads them, which a job uid could not. sandbox="enforce" runs them as real agents do
        (a uid per job, a cgroup, a clean environment): it needs root and cgroups (tests/job_uids.py
        says why not), and folders job uids can pass through (the stack's are 0711)."""
        work_dir = self.dir / "agents" / hostname
        url = self.url
        if partitionable:
            self.partitions[hostname] = Partition(self.port)
            url = f"http://127.0.0.1:{self.partitions[hostname].port}"
        argv = [PYTHON, "-m", "agent.main", "--control-plane", url,
                "--devices", f"cpu:{devices}", "--hostname", hostname, "--region", region, "--cluster", cluster,
                "--work-dir", str(work_dir), "--engine", engine, "--checkpoint-every", str(checkpoint_every),
                "--interval", "1", "--workload-root", str(ROOT), "--sandbox", sandbox, *extra]
        if sandbox != "off":
            # Job uids of their own: other stacks on this machine number their jobs from 1 too.
            argv += ["--sandbox-uid-base", str(2_000_000 + (self.port % 1000) * 65536)]
        # The enrollment token in the environment, never on the command line.
        process = self._spawn(f"agent-{hostname}", argv, env={"MERIDIAN_AGENT_ENROLL_TOKEN": ENROLL})
        self.agents[hostname] = (process, work_dir)
        poll(f"agent {hostname} to register", lambda: (work_dir / "node-token").exists(), timeout=60,
             on_timeout=lambda: self.logs(f"agent-{hostname}"))
        return process

    def kill_agent(self, hostname):
        """SIGKILLs the agent process only (its jobs' launchers live in their own sessions)."""
        process, _ = self.agents[hostname]
        process.kill()
        process.wait(timeout=10)

    def pause_agent(self, hostname):
        """SIGSTOPs the agent process only (a partition: its jobs run on, unseen)."""
        self.agents[hostname][0].send_signal(signal.SIGSTOP)

    def resume_agent(self, hostname):
        self.agents[hostname][0].send_signal(signal.SIGCONT)

    def job_pids(self, hostname=None):
        """Returns pids of launchers and ranks started by agents (all, or one agent's)."""
        pids = set()
        for name, (_process, work_dir) in self.agents.items():
            if hostname and name != hostname:
                continue
            for job_dir in (work_dir / "j").glob("*") if (work_dir / "j").exists() else []:
                for file in ("launcher.json", "progress.json"):
                    try:
                        info = json.loads((job_dir / file).read_text())
                    except (OSError, ValueError):
                        continue
                    pids.update(p for p in [info.get("pid")] + list(info.get("rank_pids") or []) if p)
        return pids

    def kill_job_processes(self, hostname=None):
        for pid in self.job_pids(hostname):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self):
        for _, process in list(self.processes.items()):
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 15
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait(timeout=10)
        self.kill_job_processes()
        for partition in self.partitions.values():
            partition.close()
        if self.redis is not None:
            self.redis.stop()

    def logs(self, *names, tail=3000):
        out = []
        for path in sorted(self.dir.glob("*.log")):
            if names and path.stem not in names:
                continue
            out.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    # --- the user API ------------------------------------------------------------------------------
    def token(self, user):
        if user not in self.tokens:
            answer = requests.post(f"{self.url}/api/auth/token/", data={"username": user, "password": PASSWORDS[user]},
                                   timeout=30)
            answer.raise_for_status()
            self.tokens[user] = answer.json()["token"]
        return self.tokens[user]

    def api(self, method, path, *, user="alice", **kwargs):
        response = requests.request(method, f"{self.url}/api/{path}",
                                    headers={"Authorization": f"Token {self.token(user)}"}, timeout=30, **kwargs)
        return response

    def submit(self, *, name, tier, world_size=1, min_devices=None, epochs=6, step_sleep=0.0, out=None, samples=256):
        args = ["--epochs", str(epochs), "--samples", str(samples)]
        if step_sleep:
            args += ["--step-sleep", str(step_sleep)]
        if out:
            args += ["--out", str(out)]
        spec = {"name": name, "tier": tier, "accelerator_type": "CPU", "world_size": world_size,
                "min_devices": min_devices or world_size, "entrypoint": TRAIN, "args": args}
        response = self.api("POST", "jobs/", json=spec)
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def job(self, job_id):
        response = self.api("GET", f"jobs/{job_id}/", user="admin")
        assert response.status_code == 200, response.text
        return response.json()

    def events(self, job_id):
        response = self.api("GET", f"jobs/{job_id}/events/?page_size=500", user="admin")
        assert response.status_code == 200, response.text
        body = response.json()
        return body["results"] if isinstance(body, dict) and "results" in body else body

    def wait_state(self, job_id, states, *, timeout=180):
        """Waits for the job to reach one of `states`; fails at once if it ends in another."""
        states = {states} if isinstance(states, str) else set(states)

        def reached():
            job = self.job(job_id)
            if job["state"] in states:
                return job
            if job["state"] in FINAL_STATES:
                raise AssertionError(f"job {job_id} ended {job['state']}, not {sorted(states)}\n"
                                     f"{self.diagnose(job_id)}")
            return None

        return poll(f"job {job_id} to reach {sorted(states)}", reached, timeout=timeout,
                    on_timeout=lambda: self.diagnose(job_id))

    def diagnose(self, *job_ids, recent=14):
        """Returns what a failed wait needs, the newest first: each job's state and its `recent` last
        events (newest last), then every agent's last warnings and errors, then the older events and
        the processes' log tails. CI's output keeps a failure's first lines and the run's last ones:
        the middle, where a long event list used to push the last events, is cut."""
        head, older = [], []
        for job_id in job_ids:
            try:
                job = self.job(job_id)
                lines = [f"  {(e.get('created_at') or '')[11:19]} {e.get('type')} {e.get('from_state')}->"
                         f"{e.get('to_state')} {e.get('reason')}" for e in self.events(job_id)]
                head.append(json.dumps({k: job.get(k) for k in ("id", "name", "state", "wait_reason",
                                                                 "progress_step", "last_checkpoint_step")}))
                if len(lines) > recent:
                    head.append(f"  ({len(lines) - recent} earlier events at the end)")
                    older += [f"job {job_id}, earlier events:"] + lines[:-recent]
                head += lines[-recent:]
            except Exception as exc:  # noqa: BLE001 - diagnostics only
                head.append(f"could not read job {job_id}: {exc}")
        for path in sorted(self.dir.glob("agent*.log")):
            noted = [line for line in path.read_text(errors="replace").splitlines()
                     if " WARNING " in line or " ERROR " in line or " launched " in line]
            if noted:
                head.append(f"--- {path.name}, last warnings, errors and launches ---")
                head += [line[:300] for line in noted[-6:]]
        return "\n".join(head + older) + "\n" + self.logs(tail=2500)

    def moves(self, job_id):
        """Returns [(kind, [steps in order])] per move of the job, from its move_step events."""
        moves = {}
        for event in self.events(job_id):
            if event.get("type") == "move_step":
                extra = event.get("extra_data") or {}
                kind, steps = moves.setdefault(extra["move"], (extra["kind"], []))
                steps.append(extra["step"])
        return [moves[key] for key in sorted(moves)]

    def nodes_of(self, job_id):
        """Returns the hostnames the job was placed on, in order, from its placed/migrated events."""
        hosts = []
        for event in self.events(job_id):
            if event.get("type") in ("placed", "migrated"):
                hosts += (event.get("extra_data") or {}).get("nodes") or []
        return hosts


def prepare_database(env):
    """Migrates the SQLite file named by env's DATABASE_URL and seeds the demo cast (no fleet)."""
    for argv in ([PYTHON, "manage.py", "migrate", "--noinput", "-v", "0"],
                 [PYTHON, "manage.py", "shell", "-c", "from jobs.demo_cast import cast_create; cast_create()"]):
        result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[1:3])} failed:\n{result.stdout}{result.stderr}")


def load_state(path):
    import torch

    return torch.load(path, weights_only=False)


def uninterrupted_run(out, *, epochs, world_size=1, samples=256, folder=None):
    """Runs TRAIN once with meridian-run's launcher, with no control plane (nothing can preempt,
    move or resize it), as ControlPlane.submit would run it (same arguments, less the step sleep);
    returns `out`, the final state it wrote. The reference a test compares a moved job with."""
    folder = pathlib.Path(folder or pathlib.Path(out).parent) / f"uninterrupted-{pathlib.Path(out).stem}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    argv = [PYTHON, "-m", "runtime.launcher", "--ranks", str(world_size), "--engine", ENGINE,
            "--job-dir", str(folder), TRAIN, "--epochs", str(epochs), "--samples", str(samples), "--out", str(out)]
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and pathlib.Path(out).exists(), \
        f"the uninterrupted run failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    return out


def assert_same_parameters(expected_path, actual_path):
    import torch

    expected, actual = load_state(expected_path), load_state(actual_path)
    assert expected["params"].keys() == actual["params"].keys()
    for name, tensor in expected["params"].items():
        assert torch.equal(tensor, actual["params"][name]), f"parameter {name} differs"
    for index, state in expected["optimizer"]["state"].items():
        for key, value in state.items():
            other = actual["optimizer"]["state"][index][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, \
                f"optimizer state {index}.{key} differs"
