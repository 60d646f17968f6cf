"""The chaos soak (issue 18): the whole stack on a private PostgreSQL and a private Redis, a steady
stream of small real training jobs of every tier, and seeded chaos; then a job-by-job audit.

    python bench/chaos_soak.py [--minutes M] [--seed S] [--agents N] [--web W] [--json PATH]

What runs (all of it torn down at the end, also on failure or Ctrl-C):
- its own PostgreSQL cluster (initdb into a temp folder, a free port, run as the `postgres` OS user
  when the soak runs as root: postgres refuses root) and its own redis-server (unix socket). It
  never touches the machine's PostgreSQL on 5432 or Redis on 6379;
- --web web processes (uvicorn, portal.web_server) behind a round-robin TCP forwarder, two Celery workers, Celery beat;
- --agents local node agents (agent.main, 1 CPU device each, framework engine), each behind a TCP
  forwarder of its own that the soak can cut (a network partition). Local agents, not the emulated
  hosts of tests/hosts: those need a network namespace, a bridge and a PID namespace per host,
  which on a 2-core machine shared by others costs what the jobs need; the partition and the
  freeze reach an agent just as well through its forwarder and SIGSTOP;
- jobs: bench/runtime_scripts/soak_train.py (examples/train_mlp.py under a witness), W 1 or 2,
  all three tiers, elastic and not, a few seconds to a minute each; a few are cancelled.

Chaos (a seeded random.Random; one event every --chaos-every seconds on average): an agent
SIGKILLed and restarted; an agent lost for good (SIGKILL of the agent and its jobs: the machine
died; a fresh node joins in its place); an agent frozen (SIGSTOP, SIGCONT a few seconds later); an
agent partitioned (its forwarder cut, healed later); a web process, a Celery worker or beat SIGKILLed and
restarted; Redis SIGKILLed and restarted (it keeps nothing: every queued task is gone); PostgreSQL
stopped with `-m immediate` (a crash) and restarted.

The audit, job by job (what each check reads is independent of what it checks where it can be):
- final state: every job ends succeeded, or cancelled if the soak cancelled it; not ended = lost;
- double runs: the witness flock (soak_train.py): no copy of a rank ever started while another
  live copy held its lock;
- results: a succeeded job's final parameters and optimizer state equal, bit for bit, those of an
  uninterrupted run of the same script and arguments (meridian-run, no control plane, before the soak);
- checkpoints: every copy resumed from a step >= every checkpoint the control plane had accepted
  (its `checkpointed` events) before that copy started;
- logs: every rank's last line ("rank r done after E epochs") is in the job's logs within a minute of the audit
  (logs ship after the fact; LOGS_SETTLE_S);
- orphans: no launcher or rank process of an ended job lives on; no store folder of a succeeded or
  cancelled one remains (a failed job's checkpoints are kept on purpose).
It prints a table (duration, jobs, kills by kind, moves, lost, wrong, double runs, p50/p99 time from
a kill to recovery, load average) and exits 1 if anything was lost, wrong, run twice or left behind.
`soak_run()` is the same thing as a function (tests/e2e/test_chaos_soak.py calls it, short).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
for extra_path in (ROOT, ROOT / "tests", ROOT / "tests" / "e2e"):
    if str(extra_path) not in sys.path:
        sys.path.insert(0, str(extra_path))

import requests  # noqa: E402
from harness import (  # noqa: E402
    BIN,
    ENROLL,
    PYTHON,
    ControlPlane,
    Partition,
    free_port,
    load_state,
    prepare_database,
)
from polling import poll  # noqa: E402

from portal.web_server import web_server_argv  # noqa: E402

SCRIPT = "bench/runtime_scripts/soak_train.py"
METRICS_TOKEN = "soak-metrics-token"
STEP_SLEEP = 0.1
SAMPLES = 128
# (W, min devices, epochs) per tier: W=1 and W=2 (min 1: elastic, spliced onto one device when short).
SHAPES = {
    "premium": [(1, 1, 6), (2, 2, 6)],
    "standard": [(2, 1, 10), (1, 1, 6)],
    "basic": [(2, 1, 10), (1, 1, 10)],
}
TIER_WEIGHTS = {"premium": 0.25, "standard": 0.35, "basic": 0.40}
CHAOS_WEIGHTS = {  # kind -> weight
    "agent_kill": 3, "agent_lost": 1, "agent_freeze": 2, "agent_partition": 2,
    "web_kill": 2, "worker_kill": 2, "beat_kill": 1, "redis_restart": 1, "postgres_restart": 1,
}
AGENT_KINDS = {"agent_kill", "agent_lost", "agent_freeze", "agent_partition"}
CANCEL_FRACTION = 0.05
# How long the audit keeps looking for a rank's last line before it counts it lost: logs ship after the fact
# (an agent that could not reach the control plane backs off up to 10 s between tries).
LOGS_SETTLE_S = 60.0
FINAL_STATES = {"succeeded", "failed", "cancelled"}


def load_average():
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# --- private PostgreSQL -------------------------------------------------------------------------------
class PrivatePostgres:
    """A PostgreSQL cluster of the soak's own: initdb into `folder`, listening on 127.0.0.1:<free port>.
    Run as the `postgres` OS user when we are root (postgres refuses root)."""

    def __init__(self, folder):
        self.folder = pathlib.Path(folder)
        self.data = self.folder / "data"
        self.port = free_port()
        self.bin = self._bin_dir()
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    @staticmethod
    def _bin_dir():
        found = sorted(pathlib.Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        if found:
            return found[-1].parent
        initdb = shutil.which("initdb")
        if not initdb:
            raise RuntimeError("no PostgreSQL server binaries (initdb) in /usr/lib/postgresql/*/bin or on PATH")
        return pathlib.Path(initdb).parent

    @property
    def url(self):
        return f"postgres://postgres@127.0.0.1:{self.port}/meridian_soak"

    def _run(self, *argv, timeout=120):
        result = subprocess.run([*self.as_user, *map(str, argv)], capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed: {result.stdout}{result.stderr}")
        return result

    def start(self):
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.as_user:
            shutil.chown(self.folder, "postgres", "postgres")
        self._run(self.bin / "initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "-E", "UTF8",
                  "--no-sync")
        with open(self.data / "postgresql.conf", "a") as conf:
            # fsync off: the soak crashes the server process, never the machine (the OS keeps what it
            # was given); synchronous_commit stays on so a crash loses no committed transaction.
            conf.write(f"\nport = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                       f"unix_socket_directories = '{self.folder}'\nfsync = off\nmax_connections = 300\n")
        self.pg_start()
        self._run(self.bin / "createdb", "-h", "127.0.0.1", "-p", self.port, "-U", "postgres", "meridian_soak")
        return self

    def pg_start(self):
        self._run(self.bin / "pg_ctl", "-D", self.data, "-l", self.folder / "postgres.log", "-w", "-t", "60", "start")

    def crash(self):
        """Stops the server the way a crash would (-m immediate: no shutdown checkpoint)."""
        self._run(self.bin / "pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")

    def stop(self, *, remove=True):
        try:
            if (self.data / "postmaster.pid").exists():
                self.crash()
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"warning: stopping the soak's PostgreSQL: {exc}", file=sys.stderr)
        if remove:
            shutil.rmtree(self.folder, ignore_errors=True)


# --- the stack -------------------------------------------------------------------------------------
class SoakStack(ControlPlane):
    """tests/e2e/harness.ControlPlane on the soak's PostgreSQL and Redis, with several web processes
    behind a balancer, two Celery workers and beat, and agents behind cuttable forwarders."""

    def __init__(self, base_dir, *, postgres, web_count=3):
        super().__init__(base_dir, env={"MERIDIAN_METRICS_TOKEN": METRICS_TOKEN,
                                        "MERIDIAN_METRICS_DIR": str(pathlib.Path(base_dir) / "metrics"),
                                        "DATABASE_URL": postgres.url,
                                        # the chaos restarts Redis and PostgreSQL: moves get time to finish
                                        "MERIDIAN_WORKFLOW_TIMEOUT_SECONDS": "90",
                                        # the stores no agent removed (a job cancelled while it
                                        # waited): collected within the orphan check's wait
                                        "MERIDIAN_ENDED_STORE_GRACE_SECONDS": "20",
                                        "MERIDIAN_ARTIFACTS_GC_SECONDS": "10"})
        self.postgres = postgres
        self.web_ports = [free_port() for _ in range(web_count)]
        self.balancer = Partition(targets=lambda: self.web_ports, connect_timeout=2)  # a frozen web is skipped
        self.port = self.balancer.port
        self.url = f"http://127.0.0.1:{self.port}"
        self.links = {}  # hostname -> its cuttable link (harness.Partition)

    def start(self, *, template_db=None):
        from portal.private_redis import PrivateRedis

        (self.dir / "data").mkdir(parents=True, exist_ok=True)
        (self.dir / "metrics").mkdir(parents=True, exist_ok=True)
        self.redis = PrivateRedis(self.dir / "redis.sock").start()
        self.env["REDIS_URL"] = self.redis.url
        prepare_database(self.env)
        for index in range(len(self.web_ports)):
            self.spawn_web(index)
        for index in range(2):
            self.spawn_worker(index)
        self.spawn_beat()
        poll("the web servers", self._answers, timeout=120, on_timeout=self.logs)
        return self

    def spawn_web(self, index):
        return self._spawn(f"web{index}", web_server_argv(bin_dir=BIN, port=self.web_ports[index]))

    def spawn_worker(self, index):
        return self._spawn(f"worker{index}", [str(BIN / "celery"), "-A", "portal", "worker", "--loglevel", "INFO",
                                              "--pool", "solo", "--hostname", f"soak{index}-{self.port}@%h"])

    def spawn_beat(self):
        return self._spawn("beat", [str(BIN / "celery"), "-A", "portal", "beat", "--loglevel", "INFO",
                                    "--schedule", str(self.dir / "data" / "beat-schedule")])

    def kill_process(self, name):
        """SIGKILLs the process group of a control-plane process (a web process, a worker, beat)."""
        process = self.processes[name]
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=30)

    def start_agent(self, hostname, *, devices=1, checkpoint_every=3.0, **_ignored):
        work_dir = self.dir / "agents" / hostname
        if hostname in self.links:
            self.links[hostname].close()
        self.links[hostname] = link = Partition(targets=lambda: [self.port], connect_timeout=2)
        argv = [PYTHON, "-m", "agent.main", "--control-plane", f"http://127.0.0.1:{link.port}",
                "--devices", f"cpu:{devices}", "--hostname", hostname, "--region", "r1", "--cluster", "c1",
                "--work-dir", str(work_dir), "--engine", "framework", "--checkpoint-every", str(checkpoint_every),
                "--interval", "1", "--workload-root", str(ROOT), "--sandbox", "off"]
        process = self._spawn(f"agent-{hostname}", argv, env={"MERIDIAN_AGENT_ENROLL_TOKEN": ENROLL})
        self.agents[hostname] = (process, work_dir)
        poll(f"agent {hostname} to register", lambda: (work_dir / "node-token").exists(), timeout=120,
             on_timeout=lambda: self.logs(f"agent-{hostname}"))
        return process

    def restart_redis(self):
        self.redis.process.kill()
        self.redis.process.wait(timeout=30)
        self.redis.socket_path.unlink(missing_ok=True)
        self.redis.start()

    def metrics_tick_count(self):
        """Returns how many ticks have completed (the /metrics histogram's count), or None."""
        try:
            text = requests.get(f"{self.url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"},
                                timeout=10).text
        except requests.RequestException:
            return None
        found = re.search(r'^meridian_tick_duration_seconds_count\{phase="total"\} ([0-9.e+]+)$', text, re.M)
        return float(found.group(1)) if found else None

    def stop(self):
        super().stop()
        self.balancer.close()
        for link in self.links.values():
            link.close()


# --- references: each shape run once, uninterrupted, without a control plane ---------------------------
def reference_runs(folder, shapes):
    """Returns {(W, epochs): path of the final state} from meridian-run runs of soak_train.py."""
    references = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for world_size, epochs in sorted(shapes):
        name = f"ref-w{world_size}-e{epochs}"
        out = folder / f"{name}.pt"
        argv = [PYTHON, "-m", "runtime.launcher", "--ranks", str(world_size), "--engine", "framework",
                "--job-dir", str(folder / name), SCRIPT, "--witness", str(folder / f"{name}-witness"),
                "--epochs", str(epochs), "--samples", str(SAMPLES), "--out", str(out)]
        result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if result.returncode != 0 or not out.exists():
            raise RuntimeError(f"reference run {name} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
        references[(world_size, epochs)] = out
    return references


def same_state(expected_path, actual_path):
    """Returns None when the two final states are bitwise equal, else what differs."""
    import torch

    try:
        expected, actual = load_state(expected_path), load_state(actual_path)
    except Exception as exc:  # noqa: BLE001 - an unreadable output is a wrong result, named
        return f"unreadable output: {exc}"
    if expected["params"].keys() != actual["params"].keys():
        return "different parameter names"
    for name, tensor in expected["params"].items():
        if not torch.equal(tensor, actual["params"][name]):
            return f"parameter {name} differs (max |diff| {(tensor - actual['params'][name]).abs().max():.3g})"
    for index, state in expected["optimizer"]["state"].items():
        for key, value in state.items():
            other = actual["optimizer"]["state"][index][key]
            if not (torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other):
                return f"optimizer state {index}.{key} differs"
    return None


# --- the soak ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SoakJob:
    name: str
    tier: str
    world_size: int
    min_devices: int
    epochs: int
    out: pathlib.Path
    witness: pathlib.Path
    job_id: int | None = None
    submitted_at: float = 0.0
    cancelled: bool = False


@dataclasses.dataclass
class ChaosEvent:
    kind: str
    target: str
    at: float
    affected: list = dataclasses.field(default_factory=list)  # job ids on the node (agent kinds)
    progress: dict = dataclasses.field(default_factory=dict)  # job id -> progress_step at the event
    tick_count: float | None = None
    recovered_at: float | None = None


@dataclasses.dataclass
class SoakResult:
    seconds: float
    jobs: int
    kills: dict
    moves: dict
    lost: list
    wrong: list
    double_runs: list
    lost_checkpoints: list
    lost_logs: list
    orphans: list
    recovery_p50: float | None
    recovery_p99: float | None
    unrecovered: int
    load: str
    states: dict

    @property
    def ok(self):
        return not (self.lost or self.wrong or self.double_runs or self.lost_checkpoints or self.lost_logs
                    or self.orphans)

    def table(self):
        def seconds(value):
            return "-" if value is None else f"{value:.1f} s"

        rows = [
            ("duration", f"{self.seconds / 60:.1f} min"),
            ("jobs submitted", str(self.jobs)),
            ("final states", ", ".join(f"{k} {v}" for k, v in sorted(self.states.items()))),
            ("kills by kind", ", ".join(f"{k} {v}" for k, v in sorted(self.kills.items())) or "none"),
            ("moves (kind: count)", ", ".join(f"{k} {v}" for k, v in sorted(self.moves.items())) or "none"),
            ("jobs lost (goal 0)", str(len(self.lost))),
            ("wrong results (goal 0)", str(len(self.wrong))),
            ("double runs (goal 0)", str(len(self.double_runs))),
            ("checkpoints lost (goal 0)", str(len(self.lost_checkpoints))),
            ("logs lost (goal 0)", str(len(self.lost_logs))),
            ("orphans left (goal 0)", str(len(self.orphans))),
            ("kill -> recovery p50", seconds(self.recovery_p50)),
            ("kill -> recovery p99", seconds(self.recovery_p99)),
            ("events not recovered by the end", str(self.unrecovered)),
            ("load average (1/5/15 min)", self.load),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
        for title, items in (("lost", self.lost), ("wrong", self.wrong), ("double runs", self.double_runs),
                             ("checkpoints lost", self.lost_checkpoints), ("logs lost", self.lost_logs),
                             ("orphans", self.orphans)):
            lines += [f"  {title}: {item}" for item in items[:20]]
        return "\n".join(lines)


def percentile(values, fraction):
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def process_commands():
    """Yields (pid, command line) of every process this soak can see (/proc)."""
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        yield int(proc.name), command


class Soak:
    def __init__(self, *, base, seconds, seed, agents, web, every, chaos_every, max_active, drain_seconds, log,
                 disrupt_max=20.0):
        self.base = pathlib.Path(base)
        self.disrupt_max = disrupt_max  # longest freeze or partition, seconds (at least 2)
        self.seconds = seconds
        self.rng = random.Random(seed)  # submissions and cancels (the main thread)
        self.chaos_rng = random.Random(seed + 1)  # the chaos thread's own: the same events for the same seed
        self.agent_count = agents
        self.web_count = web
        self.every = every
        self.chaos_every = chaos_every
        self.max_active = max_active
        self.drain_seconds = drain_seconds
        self.log = log
        self.jobs: list[SoakJob] = []
        self.events: list[ChaosEvent] = []
        self.timeline = {}  # job id -> [(time, state, progress_step)]
        self.lock = threading.Lock()
        self.stop_chaos = threading.Event()
        self.disrupted = set()  # agents frozen or cut right now
        self.lost_hosts = set()
        self.next_host = 0
        self.stack = None
        self.postgres = None

    # --- setup ------------------------------------------------------------------------------------
    def start(self):
        self.log(f"soak folder {self.base}; load {load_average()}")
        shapes = {(w, e) for tier_shapes in SHAPES.values() for w, _m, e in tier_shapes}
        (self.base / "out").mkdir(parents=True, exist_ok=True)
        self.references = reference_runs(self.base / "references", shapes)
        self.log(f"references: {sorted(self.references)}")
        self.postgres = PrivatePostgres(self.base / "pg").start()
        self.stack = SoakStack(self.base / "cp", postgres=self.postgres, web_count=self.web_count)
        self.stack.start()
        for _ in range(self.agent_count):
            self.add_agent()
        self.log(f"stack up: {self.web_count} web, 2 workers, beat, {self.agent_count} agents; load {load_average()}")

    def add_agent(self):
        self.next_host += 1
        hostname = f"n{self.next_host}"
        self.stack.start_agent(hostname)
        return hostname

    def live_agents(self):
        return [h for h in self.stack.agents if h not in self.lost_hosts]

    # --- the user side ------------------------------------------------------------------------------
    def api(self, method, path, *, user="alice", **kwargs):
        return self.stack.api(method, path, user=user, **kwargs)

    def submit_one(self, index):
        tier = self.rng.choices(list(TIER_WEIGHTS), weights=list(TIER_WEIGHTS.values()))[0]
        world_size, min_devices, epochs = self.rng.choice(SHAPES[tier])
        name = f"soak-{index}-{tier}-w{world_size}"
        job = SoakJob(name=name, tier=tier, world_size=world_size, min_devices=min_devices, epochs=epochs,
                      out=self.base / "out" / f"{name}.pt", witness=self.base / "witness" / name)
        spec = {"name": name, "tier": tier, "accelerator_type": "CPU", "world_size": world_size,
                "min_devices": min_devices, "entrypoint": SCRIPT,
                "args": ["--witness", str(job.witness), "--epochs", str(epochs), "--samples", str(SAMPLES),
                         "--step-sleep", str(STEP_SLEEP), "--out", str(job.out)]}
        job.submitted_at = time.time()
        job.job_id = self._post_job(spec)
        with self.lock:
            self.jobs.append(job)

    def _post_job(self, spec):
        """Returns the new job's id. A submission whose answer was lost (a web process or the database
        killed meanwhile) is looked up by its unique name before it is sent again, never sent twice."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                answer = self.api("POST", "jobs/", json=spec)
                if answer.status_code == 201:
                    return answer.json()["id"]
                if answer.status_code < 500:
                    raise RuntimeError(f"submission refused: {answer.status_code} {answer.text}")
            except requests.RequestException:
                found = self._find_job(spec["name"])
                if found:
                    return found
            time.sleep(1)
        raise RuntimeError(f"could not submit {spec['name']} within 300 s")

    def _find_job(self, name):
        for _ in range(60):
            try:
                for job in self._all_jobs():
                    if job["name"] == name:
                        return job["id"]
                return None
            except requests.RequestException:
                time.sleep(1)
        return None

    def _all_jobs(self):
        found, page = [], 1
        while True:
            answer = self.api("GET", f"jobs/?page_size=500&page={page}", user="admin")
            answer.raise_for_status()
            body = answer.json()
            found += body["results"]
            if not body.get("next"):
                return found
            page += 1

    def maybe_cancel(self):
        with self.lock:
            candidates = [j for j in self.jobs if not j.cancelled and j.job_id]
        if not candidates:
            return
        job = self.rng.choice(candidates)
        try:
            answer = self.api("POST", f"jobs/{job.job_id}/cancel/")
        except requests.RequestException:
            # The answer was lost: whether the cancel happened is read from the job's state at the end.
            job.cancelled = None
            return
        if answer.status_code == 200:
            job.cancelled = True
            self.log(f"cancelled {job.name} (job {job.job_id})")

    # --- observation -----------------------------------------------------------------------------
    def watch(self, stop):
        """Runs in a thread: every ~2 s records each job's state and progress, and marks the chaos
        events whose jobs (agent kinds) or ticks (control-plane kinds) have recovered."""
        while not stop.wait(2.0):
            now = time.time()
            try:
                jobs = self._all_jobs()
            except (requests.RequestException, ValueError, KeyError):
                continue
            with self.lock:
                for job in jobs:
                    self.timeline.setdefault(job["id"], []).append((now, job["state"], job["progress_step"] or 0))
                states = {job["id"]: job for job in jobs}
                pending = [e for e in self.events if e.recovered_at is None]
            tick_count = None
            for event in pending:
                if event.kind in AGENT_KINDS:
                    if all(j in states and (states[j]["state"] in FINAL_STATES
                                            or (states[j]["progress_step"] or 0) > event.progress.get(j, 0))
                           for j in event.affected):
                        event.recovered_at = now
                else:
                    if tick_count is None:
                        tick_count = self.stack.metrics_tick_count()
                    if tick_count is not None and event.tick_count is not None and tick_count >= event.tick_count + 2:
                        event.recovered_at = now

    def kill_machine_processes(self, hostname):
        """SIGKILLs every process of the node `hostname`'s jobs: each launcher and rank names a path
        under the agent's work dir on its command line (--job-dir, --spool). By command line, not by
        the pids the job folders name: a launcher started a moment ago has written none yet (the
        first 30-minute run missed one, which ran on beside the job's new copy: a double run of the
        soak's own making). Repeated until none is left (a launcher may fork a rank meanwhile)."""
        marker = f"{self.stack.dir}/agents/{hostname}/"
        for _ in range(20):
            found = [pid for pid, command in process_commands() if marker in command and pid != os.getpid()]
            if not found:
                return
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        self.log(f"warning: processes of lost node {hostname} kept coming back")

    def jobs_on(self, hostname):
        """Returns the ids of the jobs whose copies live on `hostname` (from the witness: each copy
        records its agent's job folder, agents/<host>/j/<id>.<attempt>)."""
        with self.lock:
            jobs = list(self.jobs)
        found = set()
        for job in jobs:
            for record in witness_records(job.witness):
                if f"/agents/{hostname}/j/" in (record.get("job_dir") or "") and pid_alive(record["pid"]):
                    found.add(job.job_id)
        return sorted(found)

    # --- chaos ---------------------------------------------------------------------------------
    def chaos(self):
        """Runs in a thread until stop_chaos: one seeded event every ~chaos_every seconds."""
        kinds, weights = list(CHAOS_WEIGHTS), list(CHAOS_WEIGHTS.values())
        while not self.stop_chaos.wait(self.chaos_rng.expovariate(1.0 / self.chaos_every)):
            kind = self.chaos_rng.choices(kinds, weights=weights)[0]
            try:
                self.chaos_one(kind)
            except Exception:  # noqa: BLE001 - the soak goes on; the failure is in its log
                self.log(f"chaos {kind} failed:\n{traceback.format_exc()}")

    def chaos_one(self, kind):
        stack = self.stack
        event = ChaosEvent(kind=kind, target="", at=time.time())
        # Every draw of an event is made up front, and an agent is drawn from every live one: the draws
        # never depend on timing (when a freeze or a partition ended), so the same seed gives the same
        # events. A drawn agent that is frozen or cut off already is left alone.
        rng = self.chaos_rng
        pick, seconds = rng.random(), rng.uniform(2, max(2.0, self.disrupt_max))
        pause, index = rng.uniform(0.5, 3), rng.random()
        if kind in AGENT_KINDS:
            live = sorted(self.live_agents())
            host = event.target = live[int(pick * len(live))]
            if host in self.disrupted:
                self.log(f"chaos: {kind} {host} skipped (already frozen or cut off)")
                return
            event.affected = self.jobs_on(host)
            with self.lock:
                event.progress = {j: (self.timeline.get(j) or [(0, "", 0)])[-1][2] for j in event.affected}
        else:
            event.tick_count = stack.metrics_tick_count()
        event.at = time.time()
        if kind == "agent_kill":
            stack.kill_agent(host)
            time.sleep(pause)
            stack.start_agent(host)
        elif kind == "agent_lost":
            stack.kill_agent(host)
            self.kill_machine_processes(host)  # the machine is gone, its jobs with it
            self.lost_hosts.add(host)
            stack.links[host].close()
            event.target = f"{host} (replaced by {self.add_agent()})"
        elif kind in ("agent_freeze", "agent_partition"):
            event.target = f"{host} for {seconds:.0f} s"
            self.disrupted.add(host)
            if kind == "agent_freeze":
                stack.pause_agent(host)
                undo = stack.resume_agent
            else:
                stack.links[host].cut()
                undo = lambda h: stack.links[h].heal()  # noqa: E731

            def end(host=host, undo=undo):
                undo(host)
                self.disrupted.discard(host)

            timer = threading.Timer(seconds, end)
            timer.daemon = True
            timer.start()
            self.timers.append((timer, end))
        elif kind == "web_kill":
            index = int(index * self.web_count)
            event.target = f"web{index}"
            stack.kill_process(f"web{index}")
            stack.spawn_web(index)
        elif kind == "worker_kill":
            index = int(index * 2)
            event.target = f"worker{index}"
            stack.kill_process(f"worker{index}")
            stack.spawn_worker(index)
        elif kind == "beat_kill":
            event.target = "beat"
            stack.kill_process("beat")
            stack.spawn_beat()
        elif kind == "redis_restart":
            event.target = "redis"
            stack.restart_redis()
        elif kind == "postgres_restart":
            event.target = "postgres"
            self.postgres.crash()
            time.sleep(pause)
            self.postgres.pg_start()
        with self.lock:
            self.events.append(event)
        self.log(f"chaos: {kind} {event.target} (jobs on it: {event.affected}); load {load_average()}")

    def heal_all(self):
        for timer, end in self.timers:
            if timer.is_alive():
                timer.cancel()
                end()

    # --- the run ------------------------------------------------------------------------------------
    def run(self):
        self.timers = []
        started = time.time()
        stop_watch = threading.Event()
        watcher = threading.Thread(target=self.watch, args=(stop_watch,), daemon=True, name="watch")
        watcher.start()
        chaos = threading.Thread(target=self.chaos, daemon=True, name="chaos")
        chaos.start()
        index = 0
        try:
            while time.time() - started < self.seconds:
                with self.lock:
                    latest = {j: states[-1][1] for j, states in self.timeline.items() if states}
                    active = sum(1 for j in self.jobs if latest.get(j.job_id) not in FINAL_STATES)
                if active < self.max_active:
                    index += 1
                    self.submit_one(index)
                    if self.rng.random() < CANCEL_FRACTION:
                        self.maybe_cancel()
                time.sleep(self.rng.expovariate(1.0 / self.every))
        finally:
            self.stop_chaos.set()
            chaos.join(timeout=120)
            self.heal_all()
        self.log(f"submitted {len(self.jobs)} jobs in {time.time() - started:.0f} s; draining; load {load_average()}")
        ids = [j.job_id for j in self.jobs]

        def drained():
            try:
                states = {job["id"]: job["state"] for job in self._all_jobs()}
            except requests.RequestException:
                return False
            return all(states.get(j) in FINAL_STATES for j in ids)

        try:
            poll("every job to end", drained, timeout=self.drain_seconds, interval=3)
        except AssertionError:
            self.log("drain timed out: the jobs not ended count as lost")
        # Let the last recoveries be seen before the watcher stops.
        time.sleep(4)
        stop_watch.set()
        watcher.join(timeout=30)
        return self.audit(time.time() - started)

    # --- the audit ---------------------------------------------------------------------------------
    def audit(self, seconds):
        stack = self.stack
        self._audit_began = time.monotonic()
        rows = {job["id"]: job for job in self._all_jobs()}
        lost, wrong, doubles, lost_checkpoints, lost_logs, orphans = [], [], [], [], [], []
        moves, states = {}, {}
        for job in self.jobs:
            row = rows.get(job.job_id)
            state = row["state"] if row else "missing"
            states[state] = states.get(state, 0) + 1
            label = f"{job.name} (job {job.job_id})"
            expected = "cancelled" if job.cancelled else "succeeded"
            if job.cancelled is None and state in ("cancelled", "succeeded"):
                expected = state  # a cancel whose answer was lost: either is right
            if state != expected:
                reason = (row or {}).get("failure_reason") or ""
                lost.append(f"{label}: {state}, expected {expected} {reason}".strip())
            events = stack.events(job.job_id) if row else []
            for kind in {(e.get("extra_data") or {}).get("move") and (e["extra_data"]["move"], e["extra_data"]["kind"])
                         for e in events if e.get("type") == "move_step"} - {None}:
                moves[kind[1]] = moves.get(kind[1], 0) + 1
            moves["node lost"] = moves.get("node lost", 0) + sum(1 for e in events if e.get("type") == "node_lost")
            records = witness_records(job.witness)
            for record in records:
                if record.get("double"):
                    doubles.append(f"{label}: rank {record['rank']} pid {record['pid']} started at "
                                   f"{record['started']:.1f} in {record.get('job_dir')} while another copy was live")
            if state == "succeeded":
                problem = same_state(self.references[(job.world_size, job.epochs)], job.out) \
                    if job.out.exists() else "no output file"
                if problem:
                    wrong.append(f"{label}: {problem}")
                lost_logs += self.missing_logs(job, label)
            lost_checkpoints += self.checkpoints_lost(job, label, events)
            self.write_diagnosis(job, row, events)
        orphans = self.orphans(rows)
        with self.lock:
            kills = {}
            for event in self.events:
                kills[event.kind] = kills.get(event.kind, 0) + 1
            recoveries = [e.recovered_at - e.at for e in self.events if e.recovered_at is not None]
            unrecovered = sum(1 for e in self.events if e.recovered_at is None)
        return SoakResult(seconds=seconds, jobs=len(self.jobs), kills=kills, moves=moves, lost=lost, wrong=wrong,
                          double_runs=doubles, lost_checkpoints=lost_checkpoints, lost_logs=lost_logs,
                          orphans=orphans, recovery_p50=percentile(recoveries, 0.5),
                          recovery_p99=percentile(recoveries, 0.99), unrecovered=unrecovered,
                          load=load_average(), states=states)

    def write_diagnosis(self, job, row, events):
        """Writes the job's row, events and witness to <soak folder>/jobs/<name>.txt (kept with --keep)."""
        folder = self.base / "jobs"
        folder.mkdir(exist_ok=True)
        lines = [json.dumps(row, default=str)]
        lines += [f"{e.get('created_at')} {e.get('type')} {e.get('from_state')}->{e.get('to_state')} "
                  f"{e.get('reason')} {json.dumps(e.get('extra_data'))}" for e in events]
        lines += [json.dumps(r) for r in witness_records(job.witness)]
        lines += [json.dumps(c) for c in witness_copies(job.witness)]
        (folder / f"{job.name}.txt").write_text("\n".join(lines) + "\n")

    def checkpoints_lost(self, job, label, events):
        """Each copy must resume from a step >= every checkpoint accepted before it started."""
        from datetime import datetime

        accepted = []
        for event in events:
            if event.get("type") == "checkpointed":
                at = datetime.fromisoformat(event["created_at"].replace("Z", "+00:00")).timestamp()
                accepted.append((at, (event.get("extra_data") or {}).get("step") or 0))
        starts = {(r["rank"], r["pid"]): r["started"] for r in witness_records(job.witness)}
        problems = []
        for copy in witness_copies(job.witness):
            started = starts.get((copy["rank"], copy["pid"]))
            if started is None:
                continue
            before = [step for at, step in accepted if at < started - 1.0]
            if before and copy["resumed_from"] < max(before):
                problems.append(f"{label}: rank {copy['rank']} copy pid {copy['pid']} resumed from step "
                                f"{copy['resumed_from']} though step {max(before)} was accepted before it started")
        return problems

    def missing_logs(self, job, label):
        """Returns a problem per rank whose last line is not in the job's log. Logs are shipped
        after the fact (an agent that could not reach the control plane backs off up to 10 s, and
        a job may end just as the drain ends): a missing line is looked for again until
        LOGS_SETTLE_S after the audit began, and only then counted lost."""
        while True:
            missing = self._missing_logs_now(job, label)
            if not missing or time.monotonic() > self._audit_began + LOGS_SETTLE_S:
                return missing
            time.sleep(2)

    def _missing_logs_now(self, job, label):
        texts, cursor = {}, 0  # rank -> its output, chunks joined in order (a line may span two)
        try:
            for _page in range(1000):  # the log API pages by a cursor ("next"), 1,000 chunks at most each
                answer = self.api("GET", f"jobs/{job.job_id}/logs/?after={cursor}&limit=1000", user="admin")
                answer.raise_for_status()
                body = answer.json()
                for chunk in body["chunks"]:
                    texts[chunk.get("rank")] = texts.get(chunk.get("rank"), "") + (chunk.get("text") or "")
                if not body["chunks"] or body.get("next") in (None, cursor):
                    break
                cursor = body["next"]
        except (requests.RequestException, ValueError, KeyError) as exc:
            return [f"{label}: logs unreadable: {exc}"]
        return [f"{label}: rank {rank}'s last line missing from its logs{self._where_printed(job, rank)}"
                for rank in range(job.world_size)
                if f"rank {rank} done after {job.epochs} epochs" not in texts.get(rank, "")]

    def _where_printed(self, job, rank):
        """For a missing last line: the agents' job folders whose rank log holds it, with what their
        log shipper recorded (logs-shipped.json), so a failure in CI says where the line stopped."""
        line, found = f"rank {rank} done after {job.epochs} epochs", []
        for copy in sorted((self.stack.dir / "agents").glob(f"*/j/{job.job_id}.*")):
            try:
                printed = any(line in path.read_text(errors="replace") for path in copy.glob(f"logs/rank{rank}.*"))
                shipped = (copy / "logs-shipped.json").read_text() if (copy / "logs-shipped.json").exists() else "-"
                meta = (copy / "agent.json").read_text() if (copy / "agent.json").exists() else "-"
            except OSError as exc:
                found.append(f"{copy.parent.parent.name}/{copy.name}: unreadable ({exc})")
                continue
            found.append(f"{copy.parent.parent.name}/{copy.name}: printed={printed} shipped={shipped.strip()} "
                         f"agent.json={meta.strip()} files={sorted(p.name for p in copy.iterdir())}")
        return " [copies: " + "; ".join(found or ["none left on any agent"]) + "]"

    def orphans(self, rows):
        """Returns what a finished job left behind: live processes running its script, store folders."""
        ended = {f"{j.witness} " for j in self.jobs if (rows.get(j.job_id) or {}).get("state") in FINAL_STATES}
        # A failed job's checkpoints are kept on purpose (agent/node.py removes the store of a finished
        # or cancelled job only): its store is not an orphan.
        cleaned = {j.job_id for j in self.jobs if (rows.get(j.job_id) or {}).get("state") in ("succeeded", "cancelled")}

        def leftovers():
            found = [f"process {pid}: {command[:160]}" for pid, command in process_commands()
                     if SCRIPT in command and any(witness in command for witness in ended)]
            store = self.stack.dir / "store"
            for folder in store.glob("job-*") if store.exists() else []:
                if int(folder.name.split("-")[1]) in cleaned:
                    found.append(f"store folder {folder}")
            return found

        try:
            poll("finished jobs' processes and store folders to go", lambda: not leftovers(), timeout=90, interval=2)
            return []
        except AssertionError:
            return leftovers()

    def teardown(self, *, keep=False):
        if self.stack is not None:
            try:
                for host in list(self.stack.agents):
                    try:
                        self.stack.resume_agent(host)
                    except (ProcessLookupError, OSError):
                        pass
                self.stack.stop()
            except Exception:  # noqa: BLE001 - the rest must still go
                self.log(f"stopping the stack:\n{traceback.format_exc()}")
            if self.stack.redis is not None and self.stack.redis.process and self.stack.redis.process.poll() is None:
                self.stack.redis.stop()
        if self.postgres is not None:
            self.postgres.stop(remove=not keep)


def witness_records(folder):
    records = []
    for path in sorted(pathlib.Path(folder).glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    return records


def witness_copies(folder):
    copies = []
    for path in sorted(pathlib.Path(folder).glob("copy-*.json")):
        try:
            copies.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
    return copies


def pid_alive(pid):
    try:
        os.kill(int(pid), 0)
        return True
    except (ProcessLookupError, PermissionError, ValueError):
        return False


def soak_run(*, seconds, seed=18, agents=8, web=3, every=4.0, chaos_every=12.0, max_active=10,
             drain_seconds=600, base=None, keep=False, log=print, disrupt_max=20.0):
    """Runs the soak for `seconds` (then drains), returns its SoakResult. Everything it started is
    stopped and its folder removed (unless keep=True), also when it fails. `disrupt_max`: the
    longest freeze or partition of an agent, in seconds."""
    base = pathlib.Path(base or tempfile.mkdtemp(prefix="soak-", dir="/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o711)  # the postgres user must pass through to its cluster's folder
    soak = Soak(base=base, seconds=seconds, seed=seed, agents=agents, web=web, every=every,
                chaos_every=chaos_every, max_active=max_active, drain_seconds=drain_seconds, log=log,
                disrupt_max=disrupt_max)
    try:
        soak.start()
        return soak.run()
    finally:
        soak.teardown(keep=keep)
        if not keep:
            shutil.rmtree(base, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long to submit and break things")
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--web", type=int, default=3, help="web processes (uvicorn)")
    parser.add_argument("--every", type=float, default=4.0, help="mean seconds between submissions")
    parser.add_argument("--chaos-every", type=float, default=12.0, help="mean seconds between chaos events")
    parser.add_argument("--max-active", type=int, default=10, help="unfinished jobs at most (the rest wait to be sent)")
    parser.add_argument("--drain-seconds", type=float, default=900)
    parser.add_argument("--disrupt-max", type=float, default=20.0,
                        help="longest freeze or partition of an agent, seconds (default 20: beyond the lost-node "
                             "limit of 15 s, tests/e2e/harness.py, so nodes are lost and their jobs restart from "
                             "their checkpoints)")
    parser.add_argument("--keep", action="store_true", help="keep the soak's folder (logs) at the end")
    parser.add_argument("--json", default=None, help="also write the result as JSON here")
    args = parser.parse_args()
    started = time.monotonic()

    def log(message):
        print(f"[{time.monotonic() - started:7.1f}] {message}", flush=True)

    result = soak_run(seconds=args.minutes * 60, seed=args.seed, agents=args.agents, web=args.web, every=args.every,
                      chaos_every=args.chaos_every, max_active=args.max_active, drain_seconds=args.drain_seconds,
                      keep=args.keep, log=log, disrupt_max=args.disrupt_max)
    print(result.table())
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(dataclasses.asdict(result), indent=2, default=str))
    sys.exit(0 if result.ok else 1)


if __name__ == "__main__":
    main()
