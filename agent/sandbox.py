"""The node agent's side of the per-job sandbox: the policy (enforce / auto / off), the checks made
once at start, the layout of the agent's folders, and each job's cgroup and sandbox.json. The
mechanisms are in runtime/sandbox.py (the launcher uses them too).

Modes (`meridian-agent --sandbox`, MERIDIAN_SANDBOX):
    enforce  every job runs sandboxed; when this node cannot (not root, no usable cgroups, no
             setpriv, the interpreter or the work dir out of the job uids' reach) every launch
             fails at once with the reason, which becomes the job's failure reason. The default.
    auto     sandboxed when the node can, else UNCONFINED with a warning in the agent's log at
             start and at every launch and in the job's events (Started.sandbox): the embedded
             developer profile (`./meridian run`), which may run as a normal user.
    off      unconfined, said the same way.
Whatever the mode, a job gets only its own environment (the agent's never reaches it).

Network (SandboxSpec.network, `job_network`): a sandboxed job gets what the control plane granted,
"isolated" unless the operator allowed it "host": on one host a namespace of its own, loopback only;
spanning hosts, on each host a namespace with loopback and one address of the job's block
(protocol.launch.job_part_addresses, written into the spec), routed only to its other hosts' parts
(runtime/netns.py JobNetworkPart). An unconfined job gets the node's network, which its events say.

Layout (root's unless said): <work dir> 0711 (reachable, not listable), node-token 0600, j/ 0700
(launcher logs, events, control sockets, sandbox.json 0600; <job dir>/tmp root:<job gid> 1770 is the
ranks' private /tmp, and /dev/shm/meridian-job-<id>-<nonce> their private /dev/shm, both made by the
launcher: runtime/private_dirs.py), spool/ 0711 with each job's spool root:<job gid> 1770, workspaces/
0711 with each job's workspace <job uid>:<job gid> 0700. A job's
checkpoint store folders (<store>/job-<id>/g<n>) are root:<job gid> 0750: the job reads its own
checkpoints (the framework engine's restore) and writes only into the staging folder of a
checkpoint being taken, which the launcher seals before committing it.
"""
from __future__ import annotations

import logging
import os
import pathlib
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from protocol.launch import SandboxSpec, job_part_addresses
from protocol.states import JobNetwork
from runtime import netns, private_dirs
from runtime import sandbox as mechanisms
from runtime.sandbox import Identity, JobCgroup, SandboxError

log = logging.getLogger("agent.sandbox")
MODES = ("enforce", "auto", "off")
SANDBOX_FILE = "sandbox.json"
ROOT = pathlib.Path(__file__).resolve().parent.parent
PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class SandboxPolicy:
    """What the agent was told: the mode, the uid range, the memory limit."""

    mode: str = "enforce"
    uid_base: int = mechanisms.DEFAULT_UID_BASE
    uid_count: int = mechanisms.DEFAULT_UID_COUNT
    memory_mb_per_device: int = 0  # 0: the node's memory shared out by devices

    def __post_init__(self):
        if self.mode not in MODES:
            raise SandboxError(f"sandbox mode {self.mode!r}: use one of {', '.join(MODES)}")
        mechanisms.identity_for_job(1, base=self.uid_base, count=self.uid_count)  # checks the range


def unreachable(path: os.PathLike | str) -> list[str]:
    """Returns the ancestors of `path` (and `path`) that a user other than their owner cannot pass
    through (no o+x), e.g. ["/root (mode 0700)"]: a job uid cannot reach what lies below them."""
    blocked = []
    current = pathlib.Path(os.path.realpath(path))
    for folder in [*reversed(current.parents), current]:
        try:
            mode = folder.stat().st_mode
        except OSError:
            continue
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            blocked.append(f"{folder} (mode {stat.S_IMODE(mode):04o})")
    return blocked


def node_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class NodeSandbox:
    """One node's sandboxing: decided once (`check`), then applied per launch (`prepare`)."""

    def __init__(self, policy: SandboxPolicy, *, work_dir: pathlib.Path, node_devices: int | None,
                 device_kind: str = "cpu", node_cores=None, python: str = sys.executable):
        self.policy = policy
        self.work_dir = pathlib.Path(work_dir)
        self.node_devices = node_devices
        self.device_kind = device_kind
        self.node_cores = tuple(sorted(node_cores if node_cores is not None else os.sched_getaffinity(0)))
        self.python = python
        self.cgroups: mechanisms.CgroupSystem | None = None
        # None: sandboxed; else why the jobs run unconfined (or, enforced, why they cannot run)
        self.unavailable: str | None = None
        self.check()

    # -- once, at start ------------------------------------------------------------------------------
    def check(self) -> None:
        """Decides whether this node can sandbox jobs, and says so loudly when it cannot."""
        if self.policy.mode == "off":
            self.unavailable = "the sandbox is off on this node (--sandbox off)"
            log.warning("sandbox OFF: jobs run as %s with the agent's file access (only their environment "
                        "is their own)", _user())
            return
        try:
            self.layout()  # the probe needs the spool
            self.cgroups = mechanisms.detect_cgroups()
            Identity(self.policy.uid_base, self.policy.uid_base).setpriv_prefix()
            self._probe()
        except SandboxError as exc:
            self.cgroups = None
            self.unavailable = str(exc)
            if self.policy.mode == "enforce":
                log.error("sandbox ENFORCED but unusable on this node: %s. Every job launched here fails "
                          "until this is fixed (or run the agent with --sandbox auto to run them unconfined)", exc)
            else:
                log.warning("sandbox UNAVAILABLE, jobs run UNCONFINED as %s: %s", _user(), exc)
            return
        log.info("sandbox: jobs run as uids %d..%d, cgroup %s under %s, each with a private /tmp and /dev/shm",
                 self.policy.uid_base, self.policy.uid_base + self.policy.uid_count - 1, self.cgroups.version,
                 self.cgroups.parents[0])
        if not netns.node_forwards():
            log.warning("sandbox: this node does not forward IPv4 (net.ipv4.ip_forward is not 1): a job spanning "
                        "hosts with an isolated network (the default) fails to launch here, saying so "
                        "(docs/operator-guide.md, Sandbox)")
        swept = private_dirs.sweep()  # what launchers killed with the last agent left in /dev/shm
        if swept:
            log.info("sandbox: removed %d private /dev/shm folder(s) of launchers that are gone", len(swept))

    def _probe(self) -> None:
        """Starts the runtime as a job uid once, the way a rank starts: the interpreter, the
        runtime and the spool must be within its reach. Raises SandboxError naming what is not."""
        spool = self.work_dir / "spool"
        identity = Identity(self.policy.uid_base, self.policy.uid_base)
        code = "import os, sys; import runtime.rank; os.stat(sys.argv[1])"
        env = {"PATH": mechanisms.DEFAULT_PATH, "PYTHONPATH": str(ROOT), "HOME": "/"}
        try:
            result = subprocess.run(identity.setpriv_prefix() + [self.python, "-c", code, str(spool)], env=env,
                                    cwd="/", capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SandboxError(f"a job uid could not start the runtime: {exc}") from None
        if result.returncode != 0:
            blocked = sorted(set(unreachable(self.python) + unreachable(ROOT) + unreachable(spool)))
            hint = (f"; these folders let no other user through: {', '.join(blocked)} (chmod o+x them, or "
                    f"install Python, the runtime and the work dir where job uids can reach them)") if blocked else ""
            raise SandboxError(f"uid {identity.uid} cannot start the runtime ({self.python} -m runtime.rank): "
                               f"{result.stderr.strip()[-400:]}{hint}")

    def layout(self) -> None:
        """Sets the modes of the agent's folders (see the module docstring)."""
        for folder, mode in ((self.work_dir, 0o711), (self.work_dir / "j", 0o700), (self.work_dir / "spool", 0o711),
                             (self.work_dir / "workspaces", 0o711)):
            folder.mkdir(parents=True, exist_ok=True)
            os.chmod(folder, mode)
        token = self.work_dir / "node-token"
        if token.exists():
            os.chmod(token, 0o600)

    @property
    def enforced(self) -> bool:
        return self.unavailable is None

    # -- per job -----------------------------------------------------------------------------------
    def identity(self, job_id: int) -> Identity:
        return mechanisms.identity_for_job(job_id, base=self.policy.uid_base, count=self.policy.uid_count)

    def cgroup_name(self, job_id: int) -> str:
        # Several agents may share a machine (the embedded fleet): the work dir tells them apart.
        import hashlib
        node = hashlib.sha256(str(self.work_dir).encode()).hexdigest()[:8]
        return f"node-{node}-job-{int(job_id)}"

    def memory_bytes(self, devices: int) -> int | None:
        if self.policy.memory_mb_per_device:
            return self.policy.memory_mb_per_device * devices * 2**20
        total = node_memory_bytes()
        if total is None or not self.node_devices:
            return None
        share = max(256 * 2**20, total * max(1, devices) // self.node_devices)
        return share // 4096 * 4096  # the kernel rounds a limit down to whole pages

    def prepare(self, *, job_id: int, job_dir: pathlib.Path, device_indices, devices: int, env, store=None,
                workspace=None, network: JobNetwork = JobNetwork.ISOLATED, span_nodes: int = 1) -> SandboxSpec:
        """Makes job `job_id`'s cgroup and gives it its folders; returns its SandboxSpec (written to
        <job dir>/sandbox.json). Unsandboxed nodes in mode enforce raise SandboxError. The job's
        `network` is what the control plane granted, except that an unconfined job gets the host
        network (job_network); an isolated job spanning `span_nodes` > 1 hosts gets its block's
        addresses (SandboxError when it spans more hosts than a block holds)."""
        job_network = self.job_network(network)
        addresses: tuple[str, ...] = ()
        if job_network == JobNetwork.ISOLATED and span_nodes > 1:
            try:
                addresses = job_part_addresses(job_id=job_id, nodes=span_nodes)
            except ValueError as exc:
                raise SandboxError(f"the job's isolated network cannot be given: {exc}") from None
        common: dict[str, Any] = dict(device_kind=self.device_kind, node_devices=self.node_devices,
                                      node_cores=self.node_cores, env=dict(env or {}) or None,
                                      home=str(workspace) if workspace else None,
                                      network=job_network, job_addresses=addresses)
        if not self.enforced:
            if self.policy.mode == "enforce":
                raise SandboxError(f"this node cannot sandbox jobs and its sandbox is enforced: {self.unavailable}")
            log.warning("job %s runs UNCONFINED: %s", job_id, self.unavailable)
            spec = SandboxSpec(unconfined_reason=self.unavailable, **common)
        else:
            assert self.cgroups is not None
            identity = self.identity(job_id)
            cores = sorted({c for i in (device_indices or range(devices)) for c in mechanisms.device_cores(
                int(i), node_devices=self.node_devices or max(devices, 1), node_cores=self.node_cores)})
            cgroup = JobCgroup(self.cgroups.version, self.cgroups.job_dirs(self.cgroup_name(job_id)))
            if cgroup.pids():  # a copy of an older attempt of this job on this node: it is not tracked any more
                log.warning("job %s: killing %d leftover process(es) in its cgroup", job_id, len(cgroup.kill()))
            memory = self.memory_bytes(devices)
            cgroup.create(cores=cores, memory_bytes=memory)
            spec = SandboxSpec(uid=identity.uid, gid=identity.gid, cgroup_version=self.cgroups.version,
                               cgroup_dirs=tuple(str(d) for d in cgroup.dirs), memory_bytes=memory, **common)
            self.give_store(store, identity)
            if workspace:
                root = pathlib.Path(workspace).parent  # the workspaces' root: passable, not listable
                if root.stat().st_uid == 0:
                    os.chmod(root, 0o711)
                grant_workspace(workspace, identity)
        path = pathlib.Path(job_dir) / SANDBOX_FILE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        import json
        with os.fdopen(fd, "w") as handle:
            json.dump(spec.to_dict(), handle)
        return spec

    def job_network(self, asked: JobNetwork) -> JobNetwork:
        """Returns the network a job's launcher gives it: `asked` on a sandboxed node, on one
        host or spanning hosts alike; the host network for an unconfined job (its launcher may not
        be root; its events say UNCONFINED)."""
        return asked if self.enforced else JobNetwork.HOST

    def give_workspace(self, job_id: int, path: os.PathLike | str) -> None:
        """Makes workspace `path` job `job_id`'s own (see grant_workspace) when jobs here are
        sandboxed; a no-op when they run unconfined. For the workspace code, after it unpacked or
        restored files into the workspace as root (prepare() does it too, at every launch)."""
        if self.enforced:
            grant_workspace(path, self.identity(job_id))

    @staticmethod
    def give_store(store, identity: Identity) -> None:
        """Lets the job read its own checkpoint store folders (root:<job gid> 0750), not write them."""
        if not store:
            return
        store = pathlib.Path(store)
        folders = [store.parent, store] if store.parent.name.startswith("job-") else [store]
        for folder in folders:
            if folder.is_dir() and not folder.is_symlink():
                os.lchown(folder, 0, identity.gid)
                os.chmod(folder, 0o750)
        # What it holds already (a checkpoint seeded from another generation's folder: copied
        # folders are root's, linked files keep their modes): the job's group, read only.
        for dirpath, dirnames, filenames in os.walk(store, followlinks=False):
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                info = os.lstat(path)
                if stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode):
                    os.lchown(path, 0, identity.gid)
                    os.chmod(path, 0o750 if stat.S_ISDIR(info.st_mode) else 0o640)
        blocked = unreachable(folders[0].parent)
        if blocked:
            log.warning("the checkpoint store %s is out of the job uids' reach (%s): the framework engine's "
                        "ranks cannot write their checkpoints", store, ", ".join(blocked))


def grant_workspace(path: os.PathLike | str, identity: Identity) -> None:
    """Makes the workspace `path` (a job's unpacked bundle and outputs) the job's own: owned by its
    uid, mode 0700, so its ranks write there and no other job reads it. For the workspace code to
    call once the workspace is unpacked (and again after it restored files into it as root)."""
    if os.path.isdir(path) and not os.path.islink(path):
        mechanisms.give_tree(path, identity)


def spec_of(job_dir: os.PathLike | str) -> SandboxSpec | None:
    """Returns the SandboxSpec a job was launched with (its sandbox.json), or None."""
    import json

    from protocol import ProtocolError
    try:
        with open(pathlib.Path(job_dir) / SANDBOX_FILE) as handle:
            return SandboxSpec.from_dict(json.load(handle))
    except (OSError, ValueError, ProtocolError):
        return None


def cgroup_of(job_dir: os.PathLike | str) -> JobCgroup | None:
    spec = spec_of(job_dir)
    if spec is None or not spec.cgroup_version or not spec.cgroup_dirs:
        return None
    return JobCgroup(spec.cgroup_version, spec.cgroup_dirs)


def kill_job(job_dir: os.PathLike | str) -> set[int]:
    """Kills every process of the job launched in `job_dir` at once, through its cgroup (launcher,
    ranks, criu, anything they forked); returns the pids killed (empty when it had no cgroup)."""
    cgroup = cgroup_of(job_dir)
    if cgroup is None:
        return set()
    try:
        return cgroup.kill()
    except OSError as exc:
        log.warning("could not kill the cgroup of %s: %s", job_dir, exc)
        return set()


def remove_private_dirs(job_dir: os.PathLike | str) -> list[str]:
    """After the agent killed the job launched in `job_dir`: removes what its launcher could not, its
    ranks' private /tmp (<job dir>/tmp) and, node-wide, the private /dev/shm folders of launchers
    that are gone (runtime/private_dirs.py sweep); returns what was removed. A no-op for a job
    that was not sandboxed (it had none)."""
    spec = spec_of(job_dir)
    if spec is None or spec.uid is None:
        return []
    removed = []
    tmp = pathlib.Path(job_dir) / "tmp"
    if tmp.is_dir() and not tmp.is_symlink():
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(str(tmp))
    return removed + private_dirs.sweep()


def remove_cgroup(job_dir: os.PathLike | str) -> bool:
    cgroup = cgroup_of(job_dir)
    return True if cgroup is None else cgroup.remove()


def _user() -> str:
    return "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"
