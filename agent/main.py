"""meridian-agent: the node agent. No Django: it talks to the control plane over HTTP only.

    meridian-agent --control-plane URL [--enroll-token-file F | --token-file F]
                   [--devices auto|cpu:N] [--hostname H] [--region R] [--cluster C] [--rack K]
                   [--work-dir DIR] [--engine auto|criu|framework] [--checkpoint-every S]
                   [--keep-finished-checkpoints] [--job-dir-retention-days D]
    meridian-agent --control-plane URL --hollow N [--devices cpu:8 | --hollow-type H100-80GB]

Tokens never go on the command line (any user of the host can read it in ps): the enrollment
token comes from $MERIDIAN_AGENT_ENROLL_TOKEN or --enroll-token-file, a node token from
$MERIDIAN_AGENT_TOKEN or --token-file. Neither reaches a job's environment (runtime/sandbox.py: rank_environment).

The enrollment token enrols a new node (hostname, devices) and the node token it gets is stored in
<work dir>/node-token (mode 600); a restarted agent registers again with that token (its devices
may have changed). An enrolled node cannot be enrolled again with an enrollment token: when the
control plane answers 401 (its token was revoked), an admin gives it a new one
(`manage.py fleet_node_token HOST`, then --token-file) or allows it to enrol again
(`manage.py fleet_node_token --allow-enrollment HOST`).

Beats: every liveness period the agent leases (POST lease/, liveness only) or, when a report
changed, its desired state may have changed, or telemetry is due, sends a full heartbeat
(agent/liveness.py).

Fencing: every heartbeat reply says the control plane's lost-node threshold. A thread kills
every local job (no checkpoint) once no heartbeat or lease sent in the last threshold seconds was
answered: by then the control plane counts the node lost and restarts its jobs elsewhere from
their last checkpoints. A report rejected with "fence" (a stale generation) kills that copy; one
rejected with "cancel" (the job was cancelled) kills it too and removes its checkpoint store.

Environment: MERIDIAN_CONTROL_PLANE and MERIDIAN_AGENT_WORK_DIR stand in for the flags;
MERIDIAN_AGENT_ENROLL_TOKEN and MERIDIAN_AGENT_TOKEN hold the tokens.
"""
from __future__ import annotations

import argparse
import logging
import os
import pathlib
import signal
import sys
import threading
import time

from agent.client import ControlPlaneClient, ControlPlaneError, TokenRejected, backoff_delay
from agent.devices import DeviceError, Devices, hostname_default
from agent.liveness import BeatPlanner, beat_once
from protocol import ProtocolError
from protocol.node import DesiredJob, DeviceDescription, Registration, Telemetry
from runtime import fence
from runtime.sandbox import SandboxError

log = logging.getLogger("agent")
AGENT_VERSION = "meridian-agent/0.1"


def sandbox_modes():
    from agent.sandbox import MODES
    return MODES


def parse_args(argv):
    p = argparse.ArgumentParser(prog="meridian-agent", description="Meridian node agent")
    p.add_argument("--control-plane", default=os.environ.get("MERIDIAN_CONTROL_PLANE"),
                   help="control plane base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--enroll-token-file", default=None,
                   help="a file holding the enrollment token (else $MERIDIAN_AGENT_ENROLL_TOKEN): "
                        "from `manage.py fleet_enrollment_token`")
    p.add_argument("--token-file", default=None,
                   help="a file holding a node token issued by `manage.py fleet_node_token` (else "
                        "$MERIDIAN_AGENT_TOKEN), instead of enrolling")
    for refused in ("--enroll-token", "--token"):
        p.add_argument(refused, dest=f"refused_{refused[2:].replace('-', '_')}", default=None, help=argparse.SUPPRESS)
    p.add_argument("--register-wait", type=float, default=600.0,
                   help="at start, keep trying to register this long while the control plane cannot be "
                        "reached (seconds; then exit 2)")
    p.add_argument("--devices", default="auto", help="auto (NVML) or cpu:N")
    p.add_argument("--hostname", default=None)
    p.add_argument("--region", default="local")
    p.add_argument("--cluster", default="default")
    p.add_argument("--rack", default="")
    p.add_argument("--node-addr", default=os.environ.get("MERIDIAN_NODE_ADDR", "127.0.0.1"),
                   help="this host's address the other hosts of a job reach (a job that spans hosts: its "
                        "ranks bind gloo to it, the leader's rendezvous store listens on it)")
    p.add_argument("--work-dir", default=os.environ.get("MERIDIAN_AGENT_WORK_DIR"),
                   help="job directories, spool and the node token (default ./meridian-agent-<hostname>)")
    p.add_argument("--engine", default="auto", choices=["auto", "criu", "framework"],
                   help="checkpoint engine for meridian-run")
    p.add_argument("--checkpoint-every", type=float, default=60.0,
                   help="seconds between periodic checkpoints of each running job (0 = never)")
    p.add_argument("--interval", type=float, default=None,
                   help="heartbeat seconds (default: what the control plane says)")
    p.add_argument("--workload-root", default=None,
                   help="relative entrypoints of jobs without a bundle resolve here (default cwd)")
    p.add_argument("--workspace-root", default=os.environ.get("MERIDIAN_WORKSPACE_ROOT"),
                   help="jobs' workspaces (<root>/job-<id>); the same path on every node "
                        "(default <work-dir>/workspaces)")
    p.add_argument("--hollow", type=int, default=0, help="simulate N nodes in this process (scale tests)")
    p.add_argument("--hollow-type", default="CPU", help="accelerator type of hollow nodes")
    p.add_argument("--hollow-devices", type=int, default=8, help="devices per hollow node")
    p.add_argument("--hollow-prefix", default="hollow", help="hostname prefix of hollow nodes")
    p.add_argument("--hollow-threads", type=int, default=16, help="concurrent heartbeats of hollow nodes")
    p.add_argument("--keep-finished-checkpoints", action="store_true",
                   help="keep a finished job's checkpoint store (default: removed once the control plane "
                        "has the outcome; its result is what the script wrote)")
    p.add_argument("--job-dir-retention-days", type=float, default=7.0,
                   help="remove the job directories (logs, events) of attempts that ended this long ago")
    p.add_argument("--stop-jobs-on-exit", action="store_true",
                   help="kill this agent's jobs when it stops (embedded runs); default: leave them for re-adoption")
    p.add_argument("--sandbox", default=os.environ.get("MERIDIAN_SANDBOX", "enforce"), choices=sandbox_modes(),
                   help="enforce (default): every job runs as its own uid in its own cgroup on its devices, and "
                        "fails when this node cannot do that; auto: the same when possible, else unconfined "
                        "with a warning (the embedded run); off: unconfined (see agent/sandbox.py)")
    p.add_argument("--sandbox-uid-base", type=int, default=int(os.environ.get("MERIDIAN_SANDBOX_UID_BASE", 1_000_000)),
                   help="first uid of the job uids (job uid = base + job id %% count)")
    p.add_argument("--sandbox-uid-count", type=int,
                   default=int(os.environ.get("MERIDIAN_SANDBOX_UID_COUNT", 65_536)), help="how many job uids")
    p.add_argument("--sandbox-memory-mb", type=int, default=int(os.environ.get("MERIDIAN_SANDBOX_MEMORY_MB", 0)),
                   help="memory limit of a job per device it holds, in MiB (0: the node's memory shared out "
                        "by devices)")
    p.add_argument("--log-backlog-bytes", type=int, default=64 * 1024 * 1024,
                   help="rank output kept for the control plane per rank while it cannot be reached; "
                        "older unsent output beyond it is dropped, and the drop reported (agent/logs.py)")
    p.add_argument("--log-level", default=os.environ.get("MERIDIAN_LOG_LEVEL", "INFO"))
    options = p.parse_args(argv)
    if options.refused_enroll_token is not None or options.refused_token is not None:
        p.error("tokens are not taken on the command line (every user of this host can read it): put the "
                "enrollment token in $MERIDIAN_AGENT_ENROLL_TOKEN or a file named by --enroll-token-file, a node "
                "token in $MERIDIAN_AGENT_TOKEN or --token-file")
    if not options.control_plane:
        p.error("--control-plane URL is required (or MERIDIAN_CONTROL_PLANE)")
    try:
        options.enroll_token = _secret(options.enroll_token_file, "MERIDIAN_AGENT_ENROLL_TOKEN")
        options.token = _secret(options.token_file, "MERIDIAN_AGENT_TOKEN")
    except OSError as exc:
        p.error(f"cannot read a token file: {exc}")
    if not options.token and not options.enroll_token:
        p.error("give the enrollment token ($MERIDIAN_AGENT_ENROLL_TOKEN or --enroll-token-file) to enrol this "
                "node, or its node token ($MERIDIAN_AGENT_TOKEN or --token-file)")
    return options


def _secret(path, variable):
    """Returns the token in file `path` (stripped), else in environment variable `variable`, or None."""
    if path:
        return pathlib.Path(path).read_text().strip() or None
    return os.environ.get(variable) or None


class Agent:
    def __init__(self, options, stop_event):
        from agent.node import NodeReconciler

        self.options = options
        self.stop_event = stop_event
        self.hostname = options.hostname or hostname_default()
        self.work_dir = pathlib.Path(options.work_dir or f"meridian-agent-{self.hostname}").absolute()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.devices = Devices(options.devices)
        self.client = ControlPlaneClient(options.control_plane)
        self.token_path = self.work_dir / "node-token"
        self.interval = options.interval or 5.0
        self.reconciler = NodeReconciler(self.work_dir, engine=options.engine,
                                         checkpoint_every_s=options.checkpoint_every,
                                         workload_root=options.workload_root,
                                         keep_finished_checkpoints=options.keep_finished_checkpoints,
                                         workspace_root=getattr(options, "workspace_root", None),
                                         bundle_fetcher=self.fetch_bundle,
                                         sandbox=node_sandbox(options, self.work_dir, self.devices),
                                         node_addr=getattr(options, "node_addr", None) or "127.0.0.1")
        self.desired_jobs: tuple[DesiredJob, ...] = ()
        # Self-fencing: seconds without a heartbeat the control plane answered after which this
        # node counts as lost there (its jobs restarted elsewhere); told in every heartbeat reply.
        self.lost_after_s = None
        self.last_heartbeat_ok = time.monotonic()
        self.self_fenced = False
        self.planner = BeatPlanner()

    def fetch_bundle(self, sha256):
        from agent.bundles import fetch_bundle
        return fetch_bundle(self.client, sha256, self.work_dir / "bundles")

    def registration(self) -> Registration:
        return Registration(
            hostname=self.hostname, region=self.options.region, cluster=self.options.cluster, rack=self.options.rack,
            devices=tuple(DeviceDescription(type=d["type"], memory_gb=d.get("memory_gb"), uuid=d.get("uuid"))
                          for d in self.devices.describe()),
            agent_version=AGENT_VERSION)

    def register(self, *, enrol=False):
        """Registers this node: again with its own node token when it has one (saved, or given) and
        not `enrol`, else enrols it with the enrollment token; saves the node token it gets."""
        token = None if enrol else (self.client.token or self.options.token)
        if token:
            answer = self.client.register_again(token=token, registration=self.registration())
        elif self.options.enroll_token:
            answer = self.client.register(enrollment_token=self.options.enroll_token,
                                          registration=self.registration())
        else:
            raise TokenRejected("this node has no node token and no enrollment token was given")
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(answer.token)
        if not self.options.interval:
            self.interval = float(answer.heartbeat_seconds or self.interval)
        log.info("registered %s as node %s with %d device(s)", self.hostname, answer.node_id, self.devices.count)

    def start(self):
        saved = self.token_path.read_text().strip() if self.token_path.exists() else ""
        self.client.token = saved or self.options.token or None
        try:
            self.register_when_reachable()
        except TokenRejected:
            if not (saved and self.options.enroll_token):
                raise
            # The control plane does not know the saved token (its database was replaced): enrol.
            # An enrolled node is refused here (an admin re-enrols it), never taken over.
            log.warning("the saved node token is unknown to the control plane; enrolling")
            self.register(enrol=True)

    def register_when_reachable(self, *, now=time.monotonic):
        """Registers, trying again for up to --register-wait seconds while the control plane
        cannot be reached or answers 5xx/429 (an agent started before the control plane, or while
        it restarts, is normal: `./meridian run` under load saw agents give up seconds before the
        web server listened). A refusal (4xx) is raised at once: retrying cannot change it."""
        deadline = now() + max(0.0, self.options.register_wait)
        while True:
            try:
                return self.register()
            except ControlPlaneError as exc:
                transient = exc.status is None or exc.status >= 500 or exc.status == 429
                if not transient or now() >= deadline or self.stop_event.is_set():
                    raise
                log.warning("cannot register yet (%s); trying again for up to %.0f s more", exc, deadline - now())
                self.stop_event.wait(min(5.0, max(0.0, deadline - now())))

    def beat(self):
        """One beat: a lease when it suffices, else a full heartbeat (agent/liveness.py)."""
        observed = self.reconciler.observed()
        # The control plane recorded this beat after we sent it: counting from the send keeps our
        # self-fencing clock ahead of its lost-node clock.
        answer = beat_once(client=self.client, planner=self.planner, reports=observed,
                           full_heartbeat=lambda: self.full_heartbeat(observed), alive=self.alive)
        if answer is not None:
            self.heartbeat_answered(answer)
        else:  # a lease sufficed: the desired state held is current; act on it (level-triggered)
            self.reconciler.reconcile(self.desired_jobs)

    def alive(self, sent):
        """The control plane counted this node alive as of `sent` (a lease or a heartbeat answered)."""
        self.last_heartbeat_ok = max(self.last_heartbeat_ok, sent)
        self.self_fenced = False
        self.fence_deadline_write()

    def fence_deadline_write(self):
        """Tells this node's launchers when to fence themselves should this agent fall silent
        (frozen, it could not fence them: runtime/fence.py): when it would fence them itself."""
        if self.lost_after_s is None:
            return
        try:
            fence.deadline_write(self.reconciler.fence_file, self.last_heartbeat_ok + self.lost_after_s)
        except OSError as exc:
            log.warning("could not write the fence deadline %s: %s", self.reconciler.fence_file, exc)

    def full_heartbeat(self, observed):
        telemetry = telemetry_of(self.devices.sample(self.reconciler.busy_device_indices(self.desired_jobs)))
        try:
            return self.client.heartbeat(telemetry=telemetry, jobs=observed)
        except TokenRejected as exc:
            if not self.options.enroll_token:
                raise ControlPlaneError(f"this node's token was rejected ({exc}): an admin re-enrols the node with "
                                        f"`manage.py fleet_node_token {self.hostname}` (give the agent the token in "
                                        "$MERIDIAN_AGENT_TOKEN or --token-file)", 401) from None
            # Enrolling works only where the control plane lets this hostname enrol (its database was
            # replaced, or an admin allowed it: fleet_node_token --allow-enrollment); an enrolled node
            # is refused with a 403 that says so, and this beat fails (retried with backoff).
            log.warning("node token rejected (%s); trying to enrol again", exc)
            self.register(enrol=True)
            return self.client.heartbeat(telemetry=telemetry, jobs=observed)

    def heartbeat_answered(self, answer):
        if not self.options.interval and answer.heartbeat_seconds:
            self.interval = answer.heartbeat_seconds
        if answer.desired.lost_after_seconds:
            self.lost_after_s = answer.desired.lost_after_seconds
            self.fence_deadline_write()
        self.reconciler.forget_reported(set(answer.accepted))
        fenced, cancelled = set(), set()
        for rejected in answer.rejected:
            log.warning("control plane rejected the report on job %s: %s", rejected.job_id, rejected.error)
            if rejected.fence:
                fenced.add(rejected.job_id)
            elif rejected.cancel:
                cancelled.add(rejected.job_id)
        if fenced:
            self.reconciler.fence(fenced, why="the control plane runs a newer generation elsewhere")
        if cancelled:
            self.reconciler.fence(cancelled, why="the job was cancelled", remove_store=True)
        self.desired_jobs = answer.desired.jobs
        self.reconciler.reconcile(self.desired_jobs)

    def start_log_shipper(self):
        """Streams the ranks' output to the control plane in a thread of its own, through a client
        of its own (a slow log post never delays a heartbeat)."""
        from agent.logs import LogShipper

        client = ControlPlaneClient(self.options.control_plane, token=self.client.token)
        LogShipper(self.reconciler.jobs_dir, client, backlog_limit=self.options.log_backlog_bytes,
                   token_source=lambda: self.client.token).start(self.stop_event)

    def self_fence_due(self, now=None):
        """True when this node has not heartbeated for longer than the lost-node threshold: the
        control plane has marked it lost and restarts its jobs elsewhere."""
        now = time.monotonic() if now is None else now
        return self.lost_after_s is not None and now - self.last_heartbeat_ok > self.lost_after_s

    def watch_fence(self):
        """Runs in a thread: kills every local job once self_fence_due() (a heartbeat may be stuck
        in its retries for minutes, so the beat loop cannot be the one to check)."""
        while not self.stop_event.wait(0.5):
            if self.self_fence_due() and not self.self_fenced:
                self.self_fenced = True
                killed = self.reconciler.fence(why=f"no heartbeat answered for more than {self.lost_after_s:.0f} s")
                log.warning("self-fenced: no heartbeat for more than %.0f s (the lost-node threshold); "
                            "killed %s without a checkpoint", self.lost_after_s, killed)

    def run(self):
        self.start()
        threading.Thread(target=self.watch_fence, daemon=True, name="self-fence").start()
        self.start_log_shipper()
        failures = 0
        collected_at = None
        while not self.stop_event.is_set():
            began = time.monotonic()
            if collected_at is None or began - collected_at > 3600:
                collected_at = began
                self.reconciler.collect_old_job_dirs(older_than_s=self.options.job_dir_retention_days * 86400)
            try:
                self.beat()
                failures = 0
                wait = self.interval
            except ControlPlaneError as exc:
                failures += 1
                wait = max(self.interval, backoff_delay(failures, base=1.0, cap=60.0))
                log.warning("heartbeat failed (%s); next try in %.1f s", exc, wait)
            self.stop_event.wait(max(0.0, wait - (time.monotonic() - began)))
        if self.options.stop_jobs_on_exit:
            self.reconciler.kill_all()
        return 0


def node_sandbox(options, work_dir, devices):
    """Returns the node's sandboxing as the options say (checked once, loudly: agent/sandbox.py)."""
    from agent.sandbox import NodeSandbox, SandboxPolicy
    # Options built by hand (tests of other parts) may not say: auto, which never refuses a launch.
    policy = SandboxPolicy(mode=getattr(options, "sandbox", "auto"),
                           uid_base=getattr(options, "sandbox_uid_base", SandboxPolicy.uid_base),
                           uid_count=getattr(options, "sandbox_uid_count", SandboxPolicy.uid_count),
                           memory_mb_per_device=getattr(options, "sandbox_memory_mb", 0))
    return NodeSandbox(policy, work_dir=work_dir, node_devices=devices.count,
                       device_kind="gpu" if devices.nvml is not None else "cpu")


def telemetry_of(sample: dict) -> Telemetry | None:
    """Returns the Devices.sample() readings as a Telemetry, or None (logged) when a reading is
    out of bounds: the heartbeat goes without telemetry rather than not at all."""
    try:
        return Telemetry.from_dict(sample)
    except ProtocolError as exc:
        log.warning("telemetry not sent: %s", exc)
        return None


def main(argv=None):
    options = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=options.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop_event = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop_event.set())
    signal.signal(signal.SIGINT, lambda *_: stop_event.set())
    try:
        if options.hollow:
            from agent.hollow import HollowFleet

            return HollowFleet(options, stop_event).run()
        return Agent(options, stop_event).run()
    except (DeviceError, ControlPlaneError, SandboxError) as exc:
        print(f"meridian-agent: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
