"""The sandbox of one job's ranks: an unprivileged uid, only the job's environment, its own cgroup
and exactly its devices. The mechanisms; the node agent's policy is in agent/sandbox.py.

Who is who (the launcher stays root; CRIU runs as the job's uid for its ranks: runtime/criu.py):
    agent (root)     creates the job's cgroup (cpuset = the cores behind its devices, a memory
                     limit, a freezer on v1) and its directories' modes, writes <job dir>/sandbox.json
                     (protocol.launch.SandboxSpec, mode 600) and starts the launcher with a clean
                     environment and ``--sandbox <job dir>/sandbox.json``.
    launcher (root)  joins that cgroup before anything else (everything it starts inherits it), then
                     enters the job's network namespace when the spec says "isolated"
                     (runtime/netns.py: loopback only),
                     gives the spool to the job's group, starts each rank through ``setpriv`` as
                     the job's uid with only the environment `rank_environment` builds, and moves the
                     cpuset with a resize. It reads what ranks wrote without following links
                     (`read_job_file`), and seals a framework checkpoint the ranks wrote before the
                     store commits it (`seal_tree`).
    ranks (job uid)  can write their spool, their workspace and (framework engine) the staging
                     folder of a checkpoint being taken; nothing else of the node's.

The job's uid is a function of the job id (`identity_for_job`), the same on every node: a CRIU image
carries its processes' credentials, and a restore elsewhere recreates them as they were.

Devices: device index k of a node with N devices and cores C (sorted) owns the cores
``C[k*|C|//N : max((k+1)*|C|//N, k*|C|//N + 1)]`` (`device_cores`): disjoint blocks when N <= |C|,
neighbours sharing a core when there are more devices than cores (said in the spec). On a GPU node
the ranks also get CUDA_VISIBLE_DEVICES = the job's indices, so they see their GPUs as 0..d-1
(the GPU path is not exercised on the CPU-only machines this project is tested on).
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import stat
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from protocol.states import JobNetwork
from runtime import netns, private_dirs
from runtime.private_dirs import PrivateDirs, PrivateDirsError

DEFAULT_UID_BASE = 1_000_000  # job uids: base + job id % count (no /etc/passwd entry needed)
DEFAULT_UID_COUNT = 65_536
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")
CGROUP_PARENT = "meridian"  # the job cgroups live under <this process's cgroup>/meridian/
V1_CONTROLLERS = ("cpuset", "memory", "freezer")
V2_CONTROLLERS = ("cpuset", "memory")
SPOOL_DIR_MODE = 0o1770  # root:<job gid>, sticky: a rank creates files, renames nothing it does not own
KILL_TIMEOUT_S = 10.0


class SandboxError(RuntimeError):
    """The sandbox cannot be set up; the message says why and what to do."""


# -- identity ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Identity:
    """The unprivileged uid and gid a job's ranks run as."""

    uid: int
    gid: int

    def setpriv_prefix(self) -> list[str]:
        """Returns the command prefix that runs what follows as this identity: no supplementary
        groups, no way back to privileges (no_new_privs: a setuid binary gains nothing)."""
        binary = shutil.which("setpriv")
        if binary is None:
            raise SandboxError("setpriv (util-linux) is not installed; it drops a rank to the job's uid")
        return [binary, f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--no-new-privs", "--"]


def identity_for_job(job_id: int, *, base: int = DEFAULT_UID_BASE, count: int = DEFAULT_UID_COUNT) -> Identity:
    """Returns job `job_id`'s identity: uid = gid = base + job_id % count. Two jobs share one only
    when their ids differ by a multiple of `count` (the agent refuses to run both on one node)."""
    if base < 1000 or count < 1 or base + count > 2**31 - 2:
        raise SandboxError(f"sandbox uid range {base}..{base + count - 1} is not usable: keep it above "
                           "the system's uids (base >= 1000) and below 2^31")
    uid = base + int(job_id) % count
    return Identity(uid=uid, gid=uid)


# -- devices -----------------------------------------------------------------------------------------
def parse_cores(text: str) -> tuple[int, ...]:
    """Returns the cores of a kernel cpu list ("0-3,6"), sorted; () for an empty list."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return tuple(sorted(cores))


def format_cores(cores: Iterable[int]) -> str:
    return ",".join(str(c) for c in sorted(set(cores)))


def device_cores(index: int, *, node_devices: int, node_cores: Sequence[int]) -> tuple[int, ...]:
    """Returns the cores behind node-local device `index` (see the module docstring); raises
    SandboxError for an index the node does not have."""
    cores = sorted(node_cores)
    if not cores or node_devices < 1:
        raise SandboxError(f"no cores ({cores}) or no devices ({node_devices}) to map devices onto")
    if not 0 <= index < node_devices:
        raise SandboxError(f"device index {index} is not one of this node's {node_devices} devices")
    low = index * len(cores) // node_devices
    high = max((index + 1) * len(cores) // node_devices, low + 1)
    return tuple(cores[low:high])


def devices_cores(indices: Sequence[int], *, node_devices: int, node_cores: Sequence[int]) -> list[tuple[int, ...]]:
    """Returns the cores of each device of `indices`, in their order."""
    return [device_cores(i, node_devices=node_devices, node_cores=node_cores) for i in indices]


def cuda_visible_devices(indices: Sequence[int]) -> str:
    """Returns CUDA_VISIBLE_DEVICES for a job given GPUs `indices`: the ranks see them as 0..d-1."""
    return ",".join(str(int(i)) for i in indices)


# -- environment -------------------------------------------------------------------------------------
def rank_environment(job_env: Mapping[str, str] | None, *, home: str, user: str, runtime: Mapping[str, str],
                     pythonpath: str) -> dict[str, str]:
    """Returns a rank's whole environment: a minimal base (PATH, LANG, HOME, USER), the job's own
    `job_env` (which may override the base), then `runtime` (torchrun-style and MERIDIAN_* variables,
    which the job may not override) and PYTHONPATH with the runtime first. Nothing of the
    launcher's or the agent's environment: their tokens and settings stay theirs."""
    env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", "HOME": home, "USER": user, "LOGNAME": user}
    env.update({str(k): str(v) for k, v in (job_env or {}).items()})
    env.update(runtime)
    env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# -- files the ranks write, read by root -------------------------------------------------------------
def read_job_file(path: os.PathLike | str, *, limit: int | None = None) -> bytes:
    """Returns the bytes of a regular file a rank wrote (its last `limit` bytes when given), never
    following a link at its last component: a rank that replaced its log with a link to a token
    gets an OSError here, not the token. (Its directory is root's, so no other component can be
    swapped.)"""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file")
        if limit is not None and info.st_size > limit:
            os.lseek(fd, info.st_size - limit, os.SEEK_SET)
        chunks: list[bytes] = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def copy_job_file(source: os.PathLike | str, target: os.PathLike | str) -> None:
    """Copies a regular file a rank wrote (see read_job_file) to `target`."""
    fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{source} is not a regular file")
        with os.fdopen(os.dup(fd), "rb") as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    finally:
        os.close(fd)


def seal_tree(root: os.PathLike | str, *, gid: int) -> None:
    """Makes the tree a rank wrote (a framework checkpoint's staging folder) root's, readable by the
    job's group only: dirs 0750, files 0640. Raises SandboxError, having sealed what it could, when
    the tree holds anything but directories and regular files (a link could make the store hash or
    copy a file of the node's). The top folder is sealed first, so the rank cannot add entries while
    the rest is walked; a second pass checks what the first could have missed."""
    root = pathlib.Path(root)
    strange: list[str] = []
    for _ in range(2):
        for dirpath, dirnames, filenames in os.walk(root, topdown=True, followlinks=False):
            os.lchown(dirpath, 0, gid)
            os.chmod(dirpath, 0o750)
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                info = os.lstat(path)
                if stat.S_ISDIR(info.st_mode):
                    continue  # walked next, after its parent was sealed
                if not stat.S_ISREG(info.st_mode):
                    strange.append(path)
                    os.unlink(path)
                    continue
                os.lchown(path, 0, gid)
                os.chmod(path, 0o640)
    if strange:
        raise SandboxError(f"a rank left something other than files in its checkpoint: {strange[:5]} "
                           "(links and devices are refused)")


def give_dir(path: os.PathLike | str, *, gid: int, mode: int = SPOOL_DIR_MODE) -> None:
    """Makes `path` a directory of root's that the job's group may write into (sticky: it renames
    and deletes only what it created)."""
    os.makedirs(path, exist_ok=True)
    os.lchown(path, 0, gid)
    os.chmod(path, mode)


def give_tree(path: os.PathLike | str, identity: Identity) -> None:
    """Makes everything under `path` (a workspace) the job's own, without following links."""
    for dirpath, dirnames, filenames in os.walk(os.fspath(path), followlinks=False):
        os.lchown(dirpath, identity.uid, identity.gid)
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), identity.uid, identity.gid)
    os.chmod(path, 0o700)


# -- cgroups -----------------------------------------------------------------------------------------
def _own_cgroups() -> dict[str, str]:
    """Returns this process's cgroup path per v1 controller ("" -> the v2 path)."""
    paths: dict[str, str] = {}
    with open("/proc/self/cgroup") as handle:
        for line in handle:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
    return paths


def _mount_types() -> dict[str, str]:
    types = {}
    with open("/proc/self/mounts") as handle:
        for line in handle:
            fields = line.split()
            if len(fields) >= 3:
                types[fields[1]] = fields[2]
    return types


@dataclass(frozen=True)
class CgroupSystem:
    """Which cgroup hierarchy this node gives the sandbox: "v2" (a unified /sys/fs/cgroup with
    cpuset and memory) or "v1" (cpuset, memory and freezer mounted at /sys/fs/cgroup/<name>)."""

    version: Literal["v1", "v2"]
    parents: tuple[str, ...]  # the folders under which job cgroups are made (one per v1 controller)

    def job_dirs(self, name: str) -> tuple[str, ...]:
        return tuple(os.path.join(parent, name) for parent in self.parents)


def detect_cgroups() -> CgroupSystem:
    """Returns the cgroup hierarchy to use; raises SandboxError saying why none can be."""
    if os.geteuid() != 0:
        raise SandboxError("the agent is not root, so it can make no cgroup and run no job as another uid")
    types = _mount_types()
    own = _own_cgroups()
    if types.get(str(CGROUP_ROOT)) == "cgroup2":
        available = (CGROUP_ROOT / "cgroup.controllers").read_text().split()
        missing = [c for c in V2_CONTROLLERS if c not in available]
        if missing:
            raise SandboxError(f"cgroup v2 at {CGROUP_ROOT} lacks the controller(s) {', '.join(missing)}")
        # Job cgroups hang off the root (which may hold processes and delegate controllers);
        # this process's own cgroup may not, by cgroup v2's no-internal-processes rule.
        return CgroupSystem(version="v2", parents=(str(CGROUP_ROOT / CGROUP_PARENT),))
    parents = []
    for controller in V1_CONTROLLERS:
        mount = CGROUP_ROOT / controller
        if types.get(str(mount)) != "cgroup" or controller not in own:
            raise SandboxError(f"no cgroup v2 with cpuset+memory at {CGROUP_ROOT}, and no cgroup v1 "
                               f"{controller} controller mounted at {mount}")
        parents.append(str(mount / own[controller].lstrip("/") / CGROUP_PARENT))
    return CgroupSystem(version="v1", parents=tuple(parents))


def _write(path: os.PathLike | str, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)


def _read(path: os.PathLike | str) -> str:
    with open(path) as handle:
        return handle.read().strip()


class JobCgroup:
    """One job's cgroup: a folder per v1 controller, or one v2 folder."""

    def __init__(self, version: str, dirs: Sequence[str]):
        self.version = version
        self.dirs = tuple(pathlib.Path(d) for d in dirs)

    def _dir(self, controller: str) -> pathlib.Path:
        if self.version == "v2":
            return self.dirs[0]
        for d in self.dirs:
            if d.is_relative_to(CGROUP_ROOT / controller):
                return d
        raise SandboxError(f"the job's cgroup has no {controller} folder ({self.dirs})")

    def create(self, *, cores: Sequence[int], memory_bytes: int | None) -> None:
        """Makes the cgroup (and its parents) with the cpuset `cores` and the memory limit."""
        if self.version == "v2":
            parent = self.dirs[0].parent
            parent.mkdir(exist_ok=True)
            for folder in (parent.parent, parent):
                _write(folder / "cgroup.subtree_control", " ".join(f"+{c}" for c in V2_CONTROLLERS))
            self.dirs[0].mkdir(exist_ok=True)
        else:
            for d in self.dirs:
                for folder in (d.parent, d):
                    if not folder.exists():
                        folder.mkdir()
                        if d.is_relative_to(CGROUP_ROOT / "cpuset"):
                            # v1 cpusets start empty: a child takes nothing from its parent
                            for name in ("cpuset.cpus", "cpuset.mems"):
                                _write(folder / name, _read(folder.parent / name))
        self.set_cores(cores)
        if memory_bytes:
            if self.version == "v2":
                _write(self._dir("memory") / "memory.max", str(int(memory_bytes)))
            else:
                _write(self._dir("memory") / "memory.limit_in_bytes", str(int(memory_bytes)))

    def set_cores(self, cores: Sequence[int]) -> None:
        """Sets the cpuset; the kernel moves every task's affinity inside it."""
        name = "cpuset.cpus"
        _write(self._dir("cpuset") / name, format_cores(cores))

    def cores(self) -> tuple[int, ...]:
        folder = self._dir("cpuset")
        return parse_cores(_read(folder / ("cpuset.cpus.effective" if self.version == "v2" else "cpuset.cpus")))

    def join(self, pid: int = 0) -> None:
        """Moves process `pid` (0: the caller) into the cgroup, with every controller."""
        for d in self.dirs:
            _write(d / "cgroup.procs", str(pid or os.getpid()))

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs:
            try:
                found.update(int(p) for p in _read(d / "cgroup.procs").split())
            except FileNotFoundError:
                pass
        return found

    def kill(self, timeout_s: float = KILL_TIMEOUT_S) -> set[int]:
        """SIGKILLs every process in the cgroup at once (no fork escapes: v2 cgroup.kill, or the v1
        freezer frozen around the kill); returns the pids it killed. Waits until none is left."""
        victims = self.pids()
        if not victims:
            return victims
        if self.version == "v2" and (self.dirs[0] / "cgroup.kill").exists():
            _write(self.dirs[0] / "cgroup.kill", "1")
        else:
            freezer = self._dir("freezer") if self.version == "v1" else None
            if freezer is not None:
                _write(freezer / "freezer.state", "FROZEN")
                deadline = time.monotonic() + timeout_s
                while _read(freezer / "freezer.state") != "FROZEN" and time.monotonic() < deadline:
                    time.sleep(0.005)
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if freezer is not None:
                _write(freezer / "freezer.state", "THAWED")
        deadline = time.monotonic() + timeout_s
        while self.pids() and time.monotonic() < deadline:
            for pid in self.pids():  # a fork that was in flight at the freeze
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        return victims

    def remove(self) -> bool:
        """Removes the (empty) cgroup folders; returns False while a process (or a zombie not yet
        reaped) still holds one."""
        done = True
        for d in self.dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                done = False
        return done

    def memory_limit(self) -> int | None:
        path = self._dir("memory") / ("memory.max" if self.version == "v2" else "memory.limit_in_bytes")
        text = _read(path)
        return None if text == "max" else int(text)


def read_spec_file(path: os.PathLike | str) -> dict:
    """Returns the JSON object of a sandbox.json (the launcher parses it as a SandboxSpec)."""
    with open(path) as handle:
        return json.load(handle)


class LaunchSandbox:
    """The launcher's side of a job's sandbox, from its SandboxSpec (see the module docstring)."""

    def __init__(self, spec):
        from protocol.launch import SandboxSpec
        self.spec: SandboxSpec = spec
        self.identity = Identity(spec.uid, spec.gid or spec.uid) if spec.uid is not None else None
        if self.identity is not None and os.geteuid() != 0:
            raise SandboxError(f"running the ranks as uid {spec.uid} needs a root launcher")
        self.cgroup = JobCgroup(spec.cgroup_version, spec.cgroup_dirs) if spec.cgroup_version else None
        self._prefix = self.identity.setpriv_prefix() if self.identity is not None else []
        self.private_dirs: PrivateDirs | None = None  # the ranks' own /tmp and /dev/shm, once made
        self.nodes = 1  # the hosts the job spans, as `enter` was told (its network line names them)
        self.network_part: netns.JobNetworkPart | None = None  # this host's part of a job network over hosts

    @classmethod
    def from_file(cls, path: os.PathLike | str) -> LaunchSandbox:
        from protocol.launch import SandboxSpec
        return cls(SandboxSpec.from_dict(read_spec_file(path)))

    def enter(self, *, nodes: int = 1, node_rank: int = 0) -> None:
        """Moves the launcher into the job's cgroup and, for an isolated network, into a network
        namespace of its own (runtime/netns.py), before it starts anything: every rank, every
        `criu restore` (whose restored tasks stay in criu's cgroup) inherits both. A job spanning
        `nodes` > 1 hosts gets this host's (`node_rank`) part of its routed network
        (netns.JobNetworkPart: its other parts are routed by link_peers, at the rendezvous). Raises
        SandboxError when the spec lacks the job's addresses or the node or kernel refuses."""
        self.nodes = nodes
        if self.cgroup is not None:
            self.cgroup.join()
        if self.spec.network != JobNetwork.ISOLATED:
            return
        try:
            if nodes == 1:
                netns.enter_isolated_network()
                return
            if len(self.spec.job_addresses) != nodes:
                raise SandboxError(f"the spec asks for an isolated network over {nodes} hosts but gives "
                                   f"{len(self.spec.job_addresses)} job address(es), not one per host")
            self.network_part = netns.JobNetworkPart(addresses=self.spec.job_addresses, node_rank=node_rank)
            self.network_part.enter()
        except netns.NetworkNamespaceError as exc:
            if self.network_part is not None:
                self.network_part.leave()
            raise SandboxError(f"the job's isolated network cannot be made: {exc}") from None

    @property
    def job_address(self) -> str | None:
        """This host's part's address in the job's network spanning hosts, or None (no such network)."""
        return self.network_part.address if self.network_part is not None else None

    def link_peers(self, node_addresses: dict[int, str], *, own_node_addr: str) -> None:
        """Routes the job's other hosts' parts (see netns.JobNetworkPart.link_peers); raises SandboxError."""
        if self.network_part is None:
            return
        try:
            self.network_part.link_peers(node_addresses, own_node_addr=own_node_addr)
        except netns.NetworkNamespaceError as exc:
            raise SandboxError(f"the job's isolated network cannot reach its other hosts: {exc}") from None

    def leave_network(self) -> None:
        """Removes what the node holds for the job's network part (its routes, its veth): called
        once the ranks are gone on this host. A no-op without such a part."""
        if self.network_part is not None:
            self.network_part.leave()

    def device_cores(self, indices: Sequence[int] | None) -> list[tuple[int, ...]] | None:
        """Returns the cores of each of the job's devices `indices`, or None when the node did not
        say which cores are behind which device (or the indices are unknown)."""
        if indices is None or not self.spec.node_devices or not self.spec.node_cores:
            return None
        return devices_cores(indices, node_devices=self.spec.node_devices, node_cores=self.spec.node_cores)

    def move_cores(self, cores: Iterable[int]) -> None:
        """Sets the job's cpuset (a resize: the union of old and new first, the new one after)."""
        if self.cgroup is not None:
            self.cgroup.set_cores(sorted(set(cores)))

    def make_private_dirs(self, *, job_dir: os.PathLike | str, job_id: str, keep: Iterable[os.PathLike | str]) -> None:
        """Makes the ranks' private /tmp and /dev/shm (runtime/private_dirs.py), once, before the
        first rank starts; `keep`: the node paths the ranks need (bound back where the private
        folders would hide them). First sweeps what killed launchers left in /dev/shm. A no-op when
        unconfined: such ranks share the node's, as the job's events say (UNCONFINED)."""
        if self.identity is None or self.private_dirs is not None:
            return
        private_dirs.sweep()
        try:
            self.private_dirs = PrivateDirs.create(job_dir=job_dir, job_id=job_id, gid=self.identity.gid,
                                                   keep=list(keep))
        except (OSError, PrivateDirsError) as exc:
            raise SandboxError(f"the ranks' private /tmp and /dev/shm cannot be made: {exc}") from None

    def remove_private_dirs(self) -> None:
        """Removes the private /tmp and /dev/shm: called once the ranks are gone on this host."""
        if self.private_dirs is not None:
            self.private_dirs.remove()

    def command(self, command: list[str]) -> list[str]:
        """Returns `command` run as the job's uid (unchanged when unconfined), in a mount namespace
        with the job's private /tmp and /dev/shm once they are made."""
        mounts = self.private_dirs.command() if self.private_dirs is not None else []
        return mounts + self._prefix + list(command)

    def environment(self, runtime: Mapping[str, str], *, home: str, device_indices: Sequence[int] | None,
                    pythonpath: str) -> dict[str, str]:
        runtime = dict(runtime)
        if self.spec.device_kind == "gpu" and device_indices is not None:
            # The agent numbers GPUs as NVML does, in PCI bus order; CUDA's own order (fastest
            # first) may differ on a node of mixed GPUs and would give the job others than its own.
            runtime["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            runtime["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(device_indices)
        user = f"meridian-{self.identity.uid}" if self.identity else os.environ.get("USER", "meridian")
        env = rank_environment(self.spec.env, home=self.spec.home or home, user=user, runtime=runtime,
                               pythonpath=pythonpath)
        if self.private_dirs is not None:
            env.setdefault("TMPDIR", "/tmp")  # the private one; a job may name another place of its own
        return env

    def give_spool(self, spool: pathlib.Path, rank_dirs: Iterable[pathlib.Path]) -> None:
        """Lets the job's ranks write their spool: the folder, each rank's folder and the device
        tokens' folder are root's with the job's group (SPOOL_DIR_MODE)."""
        if self.identity is None:
            return
        for folder in (spool, spool / "devices", *rank_dirs):
            give_dir(folder, gid=self.identity.gid)

    def give_workspace(self, path: os.PathLike | str) -> None:
        """Makes the workspace (and what the launcher restored into it) the job's own."""
        if self.identity is not None and os.path.isdir(path) and not os.path.islink(path):
            give_tree(path, self.identity)

    def give_file(self, path: os.PathLike | str) -> None:
        """Makes a file the launcher put back for a rank (a restored log) the rank's own."""
        if self.identity is not None:
            os.lchown(path, self.identity.uid, self.identity.gid)

    def give_staging(self, staging: os.PathLike | str) -> None:
        """Lets the ranks write a framework checkpoint into `staging` (their own, mode 700)."""
        if self.identity is not None:
            os.lchown(staging, self.identity.uid, self.identity.gid)
            os.chmod(staging, 0o700)

    def seal_staging(self, staging: os.PathLike | str) -> None:
        """Takes the staging folder back from the ranks before the store commits it (seal_tree)."""
        if self.identity is not None:
            seal_tree(staging, gid=self.identity.gid)

    def describe(self) -> str:
        """The job's `sandbox` line: SandboxSpec.describe, with the private folders once made."""
        private = ", private /tmp and /dev/shm" if self.private_dirs is not None else ""
        return self.spec.describe(nodes=self.nodes) + private


CAP_SYS_RESOURCE = 24


def criu_refusal_for_other_uids() -> str | None:
    """Returns None when CRIU run AS ROOT can dump a rank that runs as another uid here, else why not.

    CRIU reads every dumped task's rlimits (prlimit), which the kernel allows across uids only with
    CAP_SYS_RESOURCE. Some container and VM sandboxes give root every capability but that one (the
    machines this project is tested on do). A sandboxed rank is dumped by criu run as the job's own
    uid instead (runtime/criu.py JobCredentials), which needs no CAP_SYS_RESOURCE: this says only
    why root's criu would not do."""
    try:
        with open("/proc/self/status") as handle:
            effective = next(int(line.split()[1], 16) for line in handle if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return "the capabilities of this process cannot be read (/proc/self/status)"
    if not effective & (1 << CAP_SYS_RESOURCE):
        return ("CRIU cannot dump ranks that run as the job's uid here: this root lacks CAP_SYS_RESOURCE, which "
                "the kernel requires to read another uid's rlimits (prlimit)")
    return None


def criu_refusal_for_sandbox() -> str | None:
    """Returns None when CRIU can checkpoint a sandboxed job's ranks here, else why not: criu runs
    as the job's uid in its unprivileged mode, with the private /tmp and /dev/shm as external mounts
    and their contents in the checkpoint (runtime/criu.py), on one host and on each host of a job
    spanning hosts alike (runtime/engines.py dump_host_ranks, runtime/criu_parts.py). Whether CRIU
    itself works here is the engine's own check (criu.check_available)."""
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed: criu runs as the job's uid through it"
    return None
