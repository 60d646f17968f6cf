"""The chaos soak (issue 18): the whole stack on a private PostgreSQL and a private Redis, a steady
stream of small real training jobs of every tier, and seeded chaos; then a job-by-job audit.

    python bench/chaos_soak.py [--minutes M] [--seed S] [--hosts N | --local-agents N] [--web W] [--json PATH]

What runs (all of it torn down at the end, also on failure or Ctrl-C):
- its own PostgreSQL cluster (initdb into a temp folder, a free port, run as the `postgres` OS user
  when the soak runs as root: postgres refuses root) and its own redis-server (unix socket). It
  never touches the machine's PostgreSQL on 5432 or Redis on 6379;
- --web web processes (uvicorn, portal.web_server) behind a round-robin TCP forwarder, two Celery
  workers, Celery beat;
- --hosts N (the default, N = 8): N emulated hosts (tests/hosts/emulated_hosts.py: each its own
  network, mount and PID namespaces on a bridge, a freezer cgroup), a real agent inside each with 2
  CPU devices (framework engine). The hosts reach the control plane only over the bridge (the
  balancer listens on the bridge's address; the web processes on loopback); the store is the one
  mount they share (/run/meridian-store), bound at the same path in the control plane's own mount
  namespaces. The witness folders and the outputs live on that store too. Why the default: it
  costs what local agents cost (the namespaces are nearly free; the agents and the jobs are the
  same processes) and its chaos is a machine's, not a process's (a freeze stops the jobs with
  the agent; a lost host takes its namespaces with it). It needs root;
- --local-agents N: N agents as processes of this machine (1 CPU device each), each behind a TCP
  forwarder of its own that the soak cuts (a partition); a freeze stops only the agent. For
  machines where the harness cannot run;
- jobs: bench/runtime_scripts/soak_train.py (examples/train_mlp.py under a witness), all three
  tiers, elastic and not, a few seconds to a minute each; a few are cancelled. W 1 or 2 (SHAPES);
  on hosts also W 3 and 4 (SHAPES_ACROSS_HOSTS), which take two hosts (2 devices each) when they
  must: a premium W=4 needs 4 devices, an elastic W=3 or W=4 spreads when no host has room.

Chaos (a seeded random.Random; one event every --chaos-every seconds on average): an agent
SIGKILLed and restarted (inside its host: its jobs run on); a node lost for good (the host killed:
every process, its namespaces, its link; locally: the agent and its jobs SIGKILLed), a fresh one
joining in its place; a node frozen (the host's whole cgroup: agent, launchers and ranks; locally
SIGSTOP of the agent) and thawed a few seconds later; a node partitioned (the host's link cut, or
the local agent's forwarder) and healed later; a web process, a Celery worker or beat SIGKILLed and
restarted; Redis SIGKILLed and restarted (it keeps nothing: every queued task is gone); PostgreSQL
stopped with `-m immediate` (a crash) and restarted.

The audit, job by job (what each check reads is independent of what it checks where it can be):
- final state: every job ends succeeded, or cancelled if the soak cancelled it; not ended = lost;
- double runs (soak_train.py): no copy of a rank took an optimizer step after a newer copy of that
  rank had started. A copy that started while an older one still held the rank's flock is counted
  apart ("starts beside a frozen older copy"): a frozen host cannot be told from a dead one, so its
  jobs are rightly restarted elsewhere, and what must never happen is the thawed copy stepping on;
- results: a succeeded job's final parameters and optimizer state equal, bit for bit, those of an
  uninterrupted run of the same script and arguments (meridian-run, no control plane, before the soak);
- checkpoints: every copy resumed from a step >= every checkpoint the control plane had accepted
  (its `checkpointed` events) before that copy started;
- logs: every rank's last line ("rank r done after E epochs") is in the job's logs within a minute of the audit
  (logs ship after the fact; LOGS_SETTLE_S);
- orphans: no launcher or rank process of an ended job lives on, on any host (each is named with
  the host it runs on); no store folder of a succeeded or cancelled one remains (a failed job's
  checkpoints are kept on purpose).
It prints a table (duration, jobs, kills by kind, moves, lost, wrong, double runs, p50/p99 time from
a kill to recovery, load average) and exits 1 if anything was lost, wrong, run twice or left behind.
`soak_run()` is the same thing as a function (tests/hosts/test_chaos_soak.py calls it, short).
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
for extra_path in (ROOT, ROOT / "tests", ROOT / "tests" / "e2e", ROOT / "tests" / "hosts"):
    if str(extra_path) not in sys.path:
        sys.path.insert(0, str(extra_path))

import emulated_hosts  # noqa: E402 - tests/hosts: the emulated hosts' harness
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
from multihost_jobs import host_env  # noqa: E402
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
# With --hosts (2 CPU devices a host), beside those: W=4 jobs that need two hosts (premium, min 4
# devices) or may take two (standard, min 2 devices: one host's two spliced 2:1, or two hosts'; basic,
# elastic down to one device): the control loop spreads a job over hosts when it must.
SHAPES_ACROSS_HOSTS = {
    "premium": [(1, 1, 6), (2, 2, 6), (4, 4, 4)],
    "standard": [(2, 1, 10), (1, 1, 6), (4, 2, 6)],
    "basic": [(2, 1, 10), (1, 1, 10), (4, 1, 6)],
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

    def __init__(self, base_dir, *, postgres, web_count=3, bind="127.0.0.1", store=None, store_mount=None):
        """`bind`: where the balancer (the one address agents use) listens: the emulated hosts'
        bridge address with --hosts (the web processes stay on loopback, out of the hosts' reach).
        `store`: MERIDIAN_CHECKPOINT_STORE as the nodes see it; `store_mount` = (source, mount
        point): every control-plane process then runs in a mount namespace of its own with the
        shared store bound at that mount point, as a real control plane mounts the fleet's NFS at
        the nodes' path (it collects the stores of ended jobs there: jobs/bundles.py)."""
        extra = {"MERIDIAN_CHECKPOINT_STORE": str(store)} if store else {}
        if bind != "127.0.0.1":
            extra["ALLOWED_HOSTS"] = f"{bind},127.0.0.1,localhost"
        super().__init__(base_dir, env={**extra, "MERIDIAN_METRICS_TOKEN": METRICS_TOKEN,
                                        "MERIDIAN_METRICS_DIR": str(pathlib.Path(base_dir) / "metrics"),
                                        "DATABASE_URL": postgres.url,
                                        # the chaos restarts Redis and PostgreSQL: moves get time to finish
                                        "MERIDIAN_WORKFLOW_TIMEOUT_SECONDS": "90",
                                        # the stores no agent removed (a job cancelled while it
                                        # waited): collected within the orphan check's wait
                                        "MERIDIAN_ENDED_STORE_GRACE_SECONDS": "20",
                                        "MERIDIAN_ARTIFACTS_GC_SECONDS": "10"})
        self.postgres = postgres
        self.store_mount = store_mount
        self.web_ports = [free_port() for _ in range(web_count)]
        # a frozen web process is skipped
        self.balancer = Partition(targets=lambda: self.web_ports, connect_timeout=2, bind=bind)
        self.port = self.balancer.port
        self.url = f"http://{bind}:{self.port}"
        self.links = {}  # hostname -> its cuttable link (harness.Partition), local agents only

    def _spawn(self, name, argv, *, env=None):
        if self.store_mount:
            source, mount_point = self.store_mount
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", str(source), str(mount_point), *argv]
        return super()._spawn(name, argv, env=env)

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


# --- the fleet: where the agents run -------------------------------------------------------------------
class LocalFleet:
    """The agents as processes of this machine (--local): each behind a TCP forwarder of its own
    that the soak cuts (a partition); a freeze stops the agent process only (its jobs run on). For a
    machine where the emulated hosts cannot run (not root): the soak then says so in its table."""

    kind = "local agents"

    def __init__(self, base, *, devices=1):
        self.devices = devices
        self.jobs_root = pathlib.Path(base)  # the witness and the outputs: as the soak sees them ...
        self.jobs_root_arg = str(base)  # ... and as a job sees them (the same here)
        self.stack = None
        self.count = 0

    def stack_options(self):
        return {}

    def attach(self, stack):
        self.stack = stack
        self.store_dir = stack.dir / "store"

    def add(self):
        self.count += 1
        hostname = f"n{self.count}"
        self.stack.start_agent(hostname, devices=self.devices)
        return hostname

    def names(self):
        return list(self.stack.agents)

    def kill_agent(self, hostname):
        self.stack.kill_agent(hostname)

    def restart_agent(self, hostname):
        self.stack.start_agent(hostname, devices=self.devices)

    def lose(self, hostname):
        """The machine died: its agent and every process of its jobs SIGKILLed, its link closed."""
        self.stack.kill_agent(hostname)
        self._kill_machine_processes(hostname)
        self.stack.links[hostname].close()

    def freeze(self, hostname):
        self.stack.pause_agent(hostname)

    def thaw(self, hostname):
        self.stack.resume_agent(hostname)

    def cut(self, hostname):
        self.stack.links[hostname].cut()

    def heal(self, hostname):
        self.stack.links[hostname].heal()

    def _kill_machine_processes(self, hostname):
        """SIGKILLs every process of the node `hostname`'s jobs: each launcher and rank names a path
        under the agent's work dir on its command line (--job-dir, --spool). By command line, not by
        the pids the job folders name: a launcher started a moment ago has written none yet (the
        first 30-minute run missed one, which ran on beside the job's new copy: a double run of the
        soak's own making). Repeated until none is left (a launcher may fork a rank meanwhile)."""
        marker = self._marker(hostname)
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
        print(f"warning: processes of lost node {hostname} kept coming back", file=sys.stderr)

    def commands_on(self, hostname):
        """Returns the command lines of the processes of node `hostname` (its agent's job folders)."""
        marker = self._marker(hostname)
        return [command for _pid, command in process_commands() if marker in command]

    def _marker(self, hostname):
        """What every command line of node `hostname`'s processes holds: its agent's work dir."""
        return f"{self.stack.dir}/agents/{hostname}/"

    def where(self, pid, command):
        """Returns the node a process belongs to (by its command line), or "machine"."""
        found = re.search(rf"{re.escape(str(self.stack.dir))}/agents/([^/]+)/", command)
        return found.group(1) if found else "machine"

    def job_copies(self, job_id):
        """Returns [(node, folder)] of the job's copies' folders still on the nodes."""
        return [(path.parent.parent.name, path) for path in sorted((self.stack.dir / "agents").glob(f"*/j/{job_id}.*"))]

    def close(self):
        for hostname in list(self.stack.agents if self.stack else ()):
            try:
                self.stack.resume_agent(hostname)
            except (ProcessLookupError, OSError):
                pass


class HostFleet:
    """Each agent inside an emulated host of its own (tests/hosts/emulated_hosts.py: own network,
    mount and PID namespaces on a bridge, a freezer cgroup), --devices CPU devices each. The control
    plane is reachable from the hosts only over the bridge (the balancer listens on the bridge's
    address); the store is the one mount every host shares (/run/meridian-store), which the control
    plane's processes see at the same path (SoakStack store_mount). The chaos uses the harness: a
    partition is the host's link cut, a freeze the host's whole cgroup frozen (agent, launchers and
    ranks alike: a hung machine), a lost node the host killed (every process, its namespaces and
    its link; a fresh host joins), an agent kill the agent SIGKILLed inside its host and restarted
    there (its jobs' processes run on, as on a real node)."""

    kind = "emulated hosts"

    def __init__(self, count, *, devices=2):
        reason = emulated_hosts.skip_reason()
        if reason:
            raise RuntimeError(f"{reason} (bench/chaos_soak.py --local-agents N runs local agents instead)")
        self.devices = devices
        self.cluster = emulated_hosts.EmulatedHosts(count, control_plane=True)
        self.by_name = {host.name: host for host in self.cluster}
        self.agents = {}  # host name -> the Popen of the nsenter that waits for its agent
        store = pathlib.Path(self.cluster.store_dir)
        (store / "soak").mkdir(mode=0o777, exist_ok=True)
        (store / "ckpt").mkdir(mode=0o777, exist_ok=True)
        self.jobs_root = store / "soak"
        self.jobs_root_arg = f"{emulated_hosts.STORE_MOUNT}/soak"
        self.store_dir = store / "ckpt"
        self.stack = None
        self.unstarted = list(self.by_name)  # hosts made with the cluster, their agents not started yet

    def stack_options(self):
        # The control plane's mount point of the store: an empty folder on this machine's /run, over
        # which only the control plane's own mount namespaces bind the store.
        os.makedirs(emulated_hosts.STORE_MOUNT, exist_ok=True)
        return {"bind": self.cluster.control_plane_addr, "store": f"{emulated_hosts.STORE_MOUNT}/ckpt",
                "store_mount": (self.cluster.store_dir, emulated_hosts.STORE_MOUNT)}

    def attach(self, stack):
        self.stack = stack

    def add(self):
        """Starts the agent of the next host: one made with the cluster, else a fresh host that joins."""
        if self.unstarted:
            host = self.by_name[self.unstarted.pop(0)]
        else:
            host = emulated_hosts.Host(self.cluster, len(self.cluster.hosts)).start()
            self.cluster.hosts.append(host)
            self.by_name[host.name] = host
        self._start_agent(host)
        return host.name

    def _node_path(self, host, *parts):
        """A path of the host's own mounts (its /run), as this machine reaches it: through its pid 1's root."""
        return pathlib.Path(f"/proc/{host.init_pid}/root{emulated_hosts.NODE_DIR}", *parts)

    def _start_agent(self, host):
        log = open(self.stack.dir / f"agent-{host.name}.log", "ab")
        argv = [PYTHON, "-m", "agent.main", "--control-plane", self.stack.url, "--devices", f"cpu:{self.devices}",
                "--hostname", host.name, "--region", "r1", "--cluster", "c1",
                "--work-dir", f"{emulated_hosts.NODE_DIR}/agent", "--engine", "framework",
                "--checkpoint-every", "3", "--interval", "1", "--workload-root", str(ROOT),
                "--node-addr", host.address, "--sandbox", "off"]
        # The enrollment token in the environment, never on the command line.
        self.agents[host.name] = host.popen(
            argv, env=host_env({"MERIDIAN_AGENT_ENROLL_TOKEN": ENROLL, "OMP_NUM_THREADS": "1",
                                "PYTHONUNBUFFERED": "1"}),
            cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        poll(f"agent {host.name} to register", lambda: self._node_path(host, "agent", "node-token").exists(),
             timeout=120, on_timeout=lambda: self.stack.logs(f"agent-{host.name}"))

    def names(self):
        return [name for name, host in self.by_name.items() if name in self.agents and not host.killed]

    def _host_processes(self, host):
        """Returns [(pid as this machine sees it, command line)] of every process of the host (its cgroup)."""
        try:
            with open(os.path.join(host.cgroup, "cgroup.procs")) as handle:
                pids = [int(p) for p in handle.read().split()]
        except OSError:
            return []
        return list(process_commands(pids))

    def kill_agent(self, hostname):
        """SIGKILLs the agent inside its host (not the nsenter that waits for it, outside)."""
        host = self.by_name[hostname]
        for pid, command in self._host_processes(host):
            if " -m agent.main " in command and not command.startswith("nsenter"):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.agents[hostname].wait(timeout=30)

    def restart_agent(self, hostname):
        self._start_agent(self.by_name[hostname])

    def lose(self, hostname):
        self.by_name[hostname].kill()

    def freeze(self, hostname):
        self.by_name[hostname].freeze()

    def thaw(self, hostname):
        self.by_name[hostname].thaw()

    def cut(self, hostname):
        self.by_name[hostname].cut_network()

    def heal(self, hostname):
        self.by_name[hostname].restore_network()

    def commands_on(self, hostname):
        return [command for _pid, command in self._host_processes(self.by_name[hostname])]

    def where(self, pid, command):
        """Returns the host a process belongs to (its freezer cgroup), or "machine" (outside every host)."""
        try:
            lines = pathlib.Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return "gone"
        for line in lines:
            _number, controllers, path = line.split(":", 2)
            if "freezer" in controllers.split(","):
                name = path.rsplit("/", 1)[-1]
                for host in self.by_name.values():
                    if host.cgroup.endswith("/" + name):
                        return host.name
        return "machine"

    def job_copies(self, job_id):
        found = []
        for name, host in sorted(self.by_name.items()):
            if host.killed:
                continue
            found += [(name, path) for path in sorted(self._node_path(host, "agent", "j").glob(f"{job_id}.*"))]
        return found

    def close(self):
        for host in self.cluster:
            if not host.killed:
                try:
                    host.thaw()
                    host.restore_network()
                except (OSError, subprocess.CalledProcessError):
                    pass

    def teardown(self):
        self.cluster.close()


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
        # 30 min: they run beside the stack and the stream, which may starve them (600 s ran out at a load of 80)
        result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
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
    out: pathlib.Path  # as the soak reads it
    witness: pathlib.Path
    out_arg: str = ""  # as the job sees it (the same path, or the store's mount point in a host)
    witness_arg: str = ""
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
    fleet: str = ""
    across_hosts: int = 0  # jobs that ran on two or more nodes at once (a placement naming several)
    overlapping_starts: int = 0  # copies that started while an older one (frozen, being fenced) held the lock

    @property
    def ok(self):
        return not (self.lost or self.wrong or self.double_runs or self.lost_checkpoints or self.lost_logs
                    or self.orphans)

    def table(self):
        def seconds(value):
            return "-" if value is None else f"{value:.1f} s"

        rows = [
            ("duration", f"{self.seconds / 60:.1f} min"),
            ("agents on", self.fleet),
            ("jobs submitted", str(self.jobs)),
            ("jobs placed across 2+ nodes", str(self.across_hosts)),
            ("final states", ", ".join(f"{k} {v}" for k, v in sorted(self.states.items()))),
            ("kills by kind", ", ".join(f"{k} {v}" for k, v in sorted(self.kills.items())) or "none"),
            ("moves (kind: count)", ", ".join(f"{k} {v}" for k, v in sorted(self.moves.items())) or "none"),
            ("jobs lost (goal 0)", str(len(self.lost))),
            ("wrong results (goal 0)", str(len(self.wrong))),
            ("double runs (goal 0)", str(len(self.double_runs))),
            ("starts beside a frozen older copy", str(self.overlapping_starts)),
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


def process_commands(pids=None):
    """Yields (pid, command line) of the processes `pids` (default: every process this soak can see
    in /proc); a process gone meanwhile is left out."""
    if pids is None:
        pids = (int(proc.name) for proc in pathlib.Path("/proc").glob("[0-9]*"))
    for pid in pids:
        try:
            command = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        yield pid, command


class Soak:
    def __init__(self, *, base, seconds, seed, agents, web, every, chaos_every, max_active, drain_seconds, log,
                 disrupt_max=20.0, hosts=True, devices=None, shapes=None):
        self.base = pathlib.Path(base)
        self.disrupt_max = disrupt_max  # longest freeze or partition, seconds (at least 2)
        self.seconds = seconds
        self.rng = random.Random(seed)  # submissions and cancels (the main thread)
        self.chaos_rng = random.Random(seed + 1)  # the chaos thread's own: the same events for the same seed
        self.agent_count = agents
        self.hosts = hosts  # each agent in an emulated host of its own (else local agents)
        self.devices = devices or (2 if hosts else 1)
        self.fleet = None
        self._shapes = shapes
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

    @property
    def shapes(self):
        """{tier: [(W, min devices, epochs)]}: what the stream draws from."""
        return self._shapes or (SHAPES_ACROSS_HOSTS if self.hosts else SHAPES)

    # --- setup ------------------------------------------------------------------------------------
    def start(self):
        self.log(f"soak folder {self.base}; load {load_average()}")
        shapes = {(w, e) for tier_shapes in self.shapes.values() for w, _m, e in tier_shapes}
        # The references are needed only by the audit: they run while the stack starts and the stream
        # goes on (its jobs mostly sleep between steps), not before it (~3 minutes at a load of 30).
        self._references = {}

        def run_references():
            try:
                self._references["done"] = reference_runs(self.base / "references", shapes)
                self.log(f"references done: {sorted(self._references['done'])}")
            except Exception as exc:  # noqa: BLE001 - raised again by the audit, which needs them
                self._references["failed"] = exc

        self._references_thread = threading.Thread(target=run_references, daemon=True, name="references")
        self._references_thread.start()
        self.postgres = PrivatePostgres(self.base / "pg").start()
        self.fleet = (HostFleet(self.agent_count, devices=self.devices) if self.hosts
                      else LocalFleet(self.base, devices=self.devices))
        self.stack = SoakStack(self.base / "cp", postgres=self.postgres, web_count=self.web_count,
                               **self.fleet.stack_options())
        self.fleet.attach(self.stack)
        self.stack.start()
        for _ in range(self.agent_count):
            self.add_agent()
        self.log(f"stack up: {self.web_count} web, 2 workers, beat, {self.agent_count} agents "
                 f"({self.fleet.kind}, {self.devices} CPU devices each); load {load_average()}")

    def add_agent(self):
        return self.fleet.add()

    def live_agents(self):
        return [h for h in self.fleet.names() if h not in self.lost_hosts]

    # --- the user side ------------------------------------------------------------------------------
    def api(self, method, path, *, user="alice", **kwargs):
        return self.stack.api(method, path, user=user, **kwargs)

    def submit_one(self, index):
        tier = self.rng.choices(list(TIER_WEIGHTS), weights=list(TIER_WEIGHTS.values()))[0]
        world_size, min_devices, epochs = self.rng.choice(self.shapes[tier])
        name = f"soak-{index}-{tier}-w{world_size}"
        root, root_arg = self.fleet.jobs_root, self.fleet.jobs_root_arg
        for folder in ("out", "witness"):
            (root / folder).mkdir(mode=0o777, exist_ok=True)
        job = SoakJob(name=name, tier=tier, world_size=world_size, min_devices=min_devices, epochs=epochs,
                      out=root / "out" / f"{name}.pt", witness=root / "witness" / name,
                      out_arg=f"{root_arg}/out/{name}.pt", witness_arg=f"{root_arg}/witness/{name}")
        spec = {"name": name, "tier": tier, "accelerator_type": "CPU", "world_size": world_size,
                "min_devices": min_devices, "entrypoint": SCRIPT,
                "args": ["--witness", job.witness_arg, "--epochs", str(epochs), "--samples", str(SAMPLES),
                         "--step-sleep", str(STEP_SLEEP), "--out", job.out_arg]}
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

    def jobs_on(self, hostname):
        """Returns the ids of the jobs with a live process on node `hostname` (read from the node's
        processes' command lines: each rank names its job's witness folder)."""
        with self.lock:
            jobs = list(self.jobs)
        commands = self.fleet.commands_on(hostname)
        return sorted(job.job_id for job in jobs
                      if any(f"{job.witness_arg} " in command for command in commands))

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
        fleet = self.fleet
        if kind == "agent_kill":
            fleet.kill_agent(host)
            time.sleep(pause)
            fleet.restart_agent(host)
        elif kind == "agent_lost":
            fleet.lose(host)  # the machine is gone, its jobs with it
            self.lost_hosts.add(host)
            event.target = f"{host} (replaced by {self.add_agent()})"
        elif kind in ("agent_freeze", "agent_partition"):
            event.target = f"{host} for {seconds:.0f} s"
            self.disrupted.add(host)
            if kind == "agent_freeze":
                fleet.freeze(host)
                undo = fleet.thaw
            else:
                fleet.cut(host)
                undo = fleet.heal

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
    @property
    def references(self):
        """{(W, epochs): the uninterrupted run's final state}; waits for the reference runs."""
        self._references_thread.join()
        if "failed" in self._references:
            raise RuntimeError(f"the reference runs failed: {self._references['failed']}")
        return self._references["done"]

    def audit(self, seconds):
        stack = self.stack
        self.references  # noqa: B018 - waits for them before the audit's clock (LOGS_SETTLE_S) starts
        self._audit_began = time.monotonic()
        rows = {job["id"]: job for job in self._all_jobs()}
        lost, wrong, doubles, lost_checkpoints, lost_logs, orphans = [], [], [], [], [], []
        moves, states = {}, {}
        across_hosts = overlapping_starts = 0
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
            if any(len((e.get("extra_data") or {}).get("nodes") or []) >= 2 for e in events
                   if e.get("type") in ("placed", "migrated") or e.get("to_state") == "resizing"):
                across_hosts += 1
            # A double run: a copy of a rank that took an optimizer step after a newer copy of the same
            # rank had started (soak_train.py). A copy that merely started while an older one still
            # held the rank's lock is counted apart: with whole hosts frozen the control plane must
            # restart a frozen host's jobs elsewhere, and the frozen copy must then never step again.
            overlapping_starts += sum(1 for record in witness_records(job.witness) if record.get("double"))
            for copy in witness_copies(job.witness):
                if copy.get("superseded_steps"):
                    doubles.append(f"{label}: rank {copy['rank']} copy {copy.get('host')}/{copy['pid']} (resumed "
                                   f"from step {copy['resumed_from']}) took {copy['superseded_steps']} step(s), the "
                                   f"last at step {copy['last_step']}, after a newer copy started: "
                                   f"{copy.get('superseded_by')}")
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
                          load=load_average(), states=states, fleet=f"{self.fleet.kind} ({len(self.fleet.names())} "
                          f"at the end, {len(self.lost_hosts)} lost, {self.devices} devices each)",
                          across_hosts=across_hosts, overlapping_starts=overlapping_starts)

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
        # pids repeat across hosts: a copy is (rank, host, pid); its start is in its own record since session 23
        starts = {(r["rank"], r.get("host"), r["pid"]): r["started"] for r in witness_records(job.witness)}
        problems = []
        for copy in witness_copies(job.witness):
            started = copy.get("started") or starts.get((copy["rank"], copy.get("host"), copy["pid"]))
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
        for node, copy in self.fleet.job_copies(job.job_id):
            try:
                printed = any(line in path.read_text(errors="replace") for path in copy.glob(f"logs/rank{rank}.*"))
                shipped = (copy / "logs-shipped.json").read_text() if (copy / "logs-shipped.json").exists() else "-"
                meta = (copy / "agent.json").read_text() if (copy / "agent.json").exists() else "-"
            except OSError as exc:
                found.append(f"{node}/{copy.name}: unreadable ({exc})")
                continue
            found.append(f"{node}/{copy.name}: printed={printed} shipped={shipped.strip()} "
                         f"agent.json={meta.strip()} files={sorted(p.name for p in copy.iterdir())}")
        return " [copies: " + "; ".join(found or ["none left on any agent"]) + "]"

    def orphans(self, rows):
        """Returns what a finished job left behind: live processes running its script (each named with
        the node it runs on), store folders."""
        ended = {f"{j.witness_arg} " for j in self.jobs if (rows.get(j.job_id) or {}).get("state") in FINAL_STATES}
        # A failed job's checkpoints are kept on purpose (agent/node.py removes the store of a finished
        # or cancelled job only): its store is not an orphan.
        cleaned = {j.job_id for j in self.jobs if (rows.get(j.job_id) or {}).get("state") in ("succeeded", "cancelled")}

        def leftovers():
            found = [f"{self.fleet.where(pid, command)}: process {pid}: {command[:160]}"
                     for pid, command in process_commands()
                     if SCRIPT in command and any(witness in command for witness in ended)]
            store = self.fleet.store_dir
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
        if self.fleet is not None:
            try:
                self.fleet.close()
            except Exception:  # noqa: BLE001 - the rest must still go
                self.log(f"thawing the fleet:\n{traceback.format_exc()}")
        if self.stack is not None:
            try:
                self.stack.stop()
            except Exception:  # noqa: BLE001 - the rest must still go
                self.log(f"stopping the stack:\n{traceback.format_exc()}")
            if self.stack.redis is not None and self.stack.redis.process and self.stack.redis.process.poll() is None:
                self.stack.redis.stop()
        if self.postgres is not None:
            self.postgres.stop(remove=not keep)
        if isinstance(self.fleet, HostFleet):
            if keep:  # the store (witness, outputs, checkpoints) lives with the hosts: copied out first
                shutil.copytree(self.fleet.cluster.store_dir, self.base / "store", dirs_exist_ok=True,
                                ignore_dangling_symlinks=True)
            self.fleet.teardown()


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
             drain_seconds=600, base=None, keep=False, log=print, disrupt_max=20.0, hosts=True, devices=None,
             shapes=None):
    """Runs the soak for `seconds` (then drains), returns its SoakResult. Everything it started is
    stopped and its folder removed (unless keep=True), also when it fails. `disrupt_max`: the
    longest freeze or partition of an agent, in seconds. `hosts`: each of the `agents` in an emulated
    host of its own (else local agents); `devices`: CPU devices per agent (2 on hosts, 1 local);
    `shapes`: {tier: [(W, min devices, epochs)]} the jobs are drawn from (SHAPES_ACROSS_HOSTS on hosts)."""
    base = pathlib.Path(base or tempfile.mkdtemp(prefix="soak-", dir="/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o711)  # the postgres user must pass through to its cluster's folder
    soak = Soak(base=base, seconds=seconds, seed=seed, agents=agents, web=web, every=every,
                chaos_every=chaos_every, max_active=max_active, drain_seconds=drain_seconds, log=log,
                disrupt_max=disrupt_max, hosts=hosts, devices=devices, shapes=shapes)
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
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--hosts", type=int, default=None, metavar="N",
                       help="N emulated hosts, an agent in each (the default: 8; needs root)")
    where.add_argument("--local-agents", type=int, default=None, metavar="N",
                       help="N agents as local processes instead (no root needed; weaker chaos: see the docstring)")
    parser.add_argument("--devices", type=int, default=None, help="CPU devices per agent (default 2 on hosts, 1 local)")
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
    # A soak started in the background of a non-interactive shell ignores SIGINT; SIGTERM's default
    # ends it without its teardown (its PostgreSQL, control plane and hosts would live on). Both end it
    # through the `finally` of soak_run instead.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    def log(message):
        print(f"[{time.monotonic() - started:7.1f}] {message}", flush=True)

    hosts = args.local_agents is None
    agents = args.local_agents if not hosts else (args.hosts or 8)
    if hosts and (reason := emulated_hosts.skip_reason()):
        parser.error(f"{reason}; --local-agents N runs the soak on local agents")
    result = soak_run(seconds=args.minutes * 60, seed=args.seed, agents=agents, web=args.web, every=args.every,
                      chaos_every=args.chaos_every, max_active=args.max_active, drain_seconds=args.drain_seconds,
                      keep=args.keep, log=log, disrupt_max=args.disrupt_max, hosts=hosts, devices=args.devices)
    print(result.table())
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(dataclasses.asdict(result), indent=2, default=str))
    sys.exit(0 if result.ok else 1)


if __name__ == "__main__":
    main()
