"""Emulated hosts: N "machines" on this one, each with its own network, mount, PID and UTS namespace.

    with EmulatedHosts(3) as hosts:          # or the `emulated_hosts` pytest fixture
        a, b, c = hosts
        a.run(["hostname"])                   # -> "mh-0"
        b.popen([sys.executable, "-m", "runtime.launcher", ...])
        b.cut_network(); b.restore_network()
        c.freeze(); c.thaw(); c.kill()

What each host has of its own:
- network: a network namespace holding only `lo` and `eth0`, one end of a veth pair whose other
  end is on a bridge the harness makes (`mrdh<tag>`); its address is 10.213.<x>.<10+i>/24 on a
  subnet no link of this machine uses yet. No default route, so a host reaches the other hosts'
  addresses and nothing else: not the machine's own interfaces, not another host's loopback.
  Each host forwards IPv4 (net.ipv4.ip_forward=1), as a node running isolated jobs across
  hosts must (runtime/netns.py). With `control_plane=True` the bridge itself gets 10.213.<x>.1
  (the control plane's address,
  `hosts.control_plane_addr`): that is the one address of the real machine a host can reach.
  No iptables/nft is installed on this machine kind, so no filter rules are added: the
  isolation is the namespaces' and the routes'.
- mounts: a private mount namespace with fresh tmpfs on /dev/shm, /run and /tmp (so the spool,
  /run/meridian, lives per host, as does every shared-memory file) and a node-local directory
  `/run/meridian-node`. The harness's own directory is hidden under a tmpfs, so one host cannot
  read another's files through it.
- processes: a PID namespace whose init (pid 1) is a small reaper (tests/hosts/host_init.py);
  a host sees only its own processes.
- a freezer cgroup (cgroup v1 on this machine) holding every process of the host: `freeze()`.

What hosts share, as real hosts do:
- the network between their addresses (and the control plane's address, when asked for);
- the artifact/checkpoint store: a directory bind-mounted at `/run/meridian-store` in every
  host. It stands in for an NFS/Lustre mount: the runtime only ever uses it through plain file
  operations with atomic renames (runtime/store.py, runtime/rendezvous.py), the operations an
  object store's put-if-absent / get / list also give, so an object-store backend can replace it.
- the machine's root file system as a read-mostly "image" (the OS, Python, the repository and its
  venv): what every node of a fleet has installed alike. Nothing a job writes goes there: its
  writable places are the host's tmpfs mounts and the shared store.

Root only (namespaces, links, mounts, cgroups): `skip_reason()` says why it cannot run. Every
namespace, link, cgroup and directory made is removed by close(), also after a failed test, and
`sweep_leftovers()` (run before every start) removes whatever a harness that died left behind,
found by the name prefix and an owner pid that no longer lives.
"""
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

PREFIX = "mrdh"  # links, cgroups and state folders of this harness start with it
def _image_paths_under_tmp() -> list[str]:
    """The checkout and the Python environment, when they lie under /tmp: every host mounts a /tmp
    of its own, so these are bound back into it (they are the hosts' "installed image")."""
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = {os.path.realpath(checkout), os.path.realpath(sys.prefix)}
    tops = sorted(p for p in paths if p.startswith("/tmp/"))
    return [p for p in tops if not any(p != q and p.startswith(q + "/") for q in tops)]


STATE_ROOT = "/var/tmp/meridian-hosts"  # not under /tmp: each host mounts its own /tmp
# The shared stores, one folder per tag, outside the hidden STATE_ROOT/<tag>: a host's bind of its
# store lies on the machine's root file system, and a sandboxed rank's mount namespace holds it, so
# criu, restoring that namespace AS THE JOB'S UID (runtime/criu.py), re-binds it from its path on
# that file system: under the harness's hidden folder (a tmpfs of mode 700 over STATE_ROOT/<tag>)
# that path was unreachable ("Can't bind-mount ... /run/meridian-store: Permission denied"). A real
# fleet's store is a file system of its own (NFS, Lustre), mapped by its mount point instead.
STORE_ROOT = "/var/tmp/meridian-host-stores"
FREEZER_ROOT = "/sys/fs/cgroup/freezer"
STORE_MOUNT = "/run/meridian-store"  # where every host sees the shared store
NODE_DIR = "/run/meridian-node"  # node-local, per host
HOST_INIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_init.py")
SUBNET_BASE = "10.213"
START_TIMEOUT_S = 30.0


class HarnessError(RuntimeError):
    pass


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def skip_reason():
    """Returns why emulated hosts cannot run here (a sentence), or None when they can."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network, mount and PID namespaces, a bridge, cgroups)"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"emulated hosts need `{tool}` (util-linux / iproute2), which is not on PATH"
    if not os.path.isdir(FREEZER_ROOT) and not os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        return "emulated hosts need a cgroup freezer (v1 at /sys/fs/cgroup/freezer or cgroup v2)"
    return None


def process_running(pid):
    """True while `pid` exists and is not a zombie (a killed process whose parent has not
    reaped it yet is dead for every purpose of a test)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _links():
    """Returns the names of this machine's links (root network namespace)."""
    out = _ip("-o", "link", "show").stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def _kill_cgroup(path, timeout_s=10.0):
    """SIGKILLs every task of a freezer cgroup (thawing it, or frozen tasks never die), then
    removes it. Returns quietly if it does not exist."""
    if not os.path.isdir(path):
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(os.path.join(path, "cgroup.procs")) as handle:
                pids = [int(p) for p in handle.read().split()]
        except FileNotFoundError:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _freezer_write(path, "THAWED")
        if not pids:
            break
        if time.monotonic() > deadline:
            raise HarnessError(f"processes {pids} of {path} did not die within {timeout_s} s")
        time.sleep(0.02)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass


def _freezer_write(path, state):
    try:
        with open(os.path.join(path, "freezer.state"), "w") as handle:
            handle.write(state)
    except FileNotFoundError:
        pass


def _teardown_tag(tag):
    """Removes everything a harness with this tag made: processes (via its cgroups), links, state."""
    if os.path.isdir(FREEZER_ROOT):
        for name in os.listdir(FREEZER_ROOT):
            if name.startswith(f"{PREFIX}{tag}"):
                _kill_cgroup(os.path.join(FREEZER_ROOT, name))
    for link in _links():
        if link.startswith(f"{PREFIX}{tag}"):
            _ip("link", "delete", link, check=False)
    shutil.rmtree(os.path.join(STATE_ROOT, tag), ignore_errors=True)
    shutil.rmtree(os.path.join(STORE_ROOT, tag), ignore_errors=True)


def sweep_leftovers():
    """Removes the namespaces' processes, links, cgroups and folders of harnesses whose owner
    process is gone (a test run that was killed before its finalizers ran). Returns the tags."""
    swept = []
    tags = set()
    for root in (STATE_ROOT, STORE_ROOT):
        if os.path.isdir(root):
            tags.update(os.listdir(root))
    for link in _links():
        if link.startswith(PREFIX) and len(link) >= len(PREFIX) + 4:
            tags.add(link[len(PREFIX):len(PREFIX) + 4])
    if os.path.isdir(FREEZER_ROOT):
        for name in os.listdir(FREEZER_ROOT):
            if name.startswith(PREFIX):
                tags.add(name[len(PREFIX):len(PREFIX) + 4])
    for tag in sorted(tags):
        owner = None
        try:
            with open(os.path.join(STATE_ROOT, tag, "owner")) as handle:
                owner = int(handle.read().strip() or 0)
        except (OSError, ValueError):
            pass
        if owner and _pid_alive(owner):
            continue
        if owner is None and _made_lately(tag):
            continue  # another run's harness between making its folders and writing its owner file
        _teardown_tag(tag)
        swept.append(tag)
    return swept


OWNERLESS_GRACE_S = 60


def _made_lately(tag):
    """True when a folder of `tag` was made less than OWNERLESS_GRACE_S ago."""
    for root in (STATE_ROOT, STORE_ROOT):
        try:
            if time.time() - os.stat(os.path.join(root, tag)).st_mtime < OWNERLESS_GRACE_S:
                return True
        except OSError:
            pass
    return False


def _free_subnet():
    """Returns an x such that no address of this machine is in 10.213.x.0/24."""
    used = _ip("-o", "-4", "addr", "show").stdout
    for _ in range(200):
        x = secrets.randbelow(250) + 1
        if f" {SUBNET_BASE}.{x}." not in used:
            return x
    raise HarnessError(f"no free {SUBNET_BASE}.x.0/24 subnet")


class Host:
    """One emulated host (see the module docstring). Made by EmulatedHosts."""

    def __init__(self, cluster, index):
        self.cluster = cluster
        self.index = index
        self.name = f"mh-{index}"
        self.address = f"{SUBNET_BASE}.{cluster.subnet}.{10 + index}"
        self.link = f"{PREFIX}{cluster.tag}v{index}"  # the bridge side of its veth pair
        self.cgroup = os.path.join(FREEZER_ROOT, f"{PREFIX}{cluster.tag}h{index}")
        self.init = None  # the `unshare` process; its child is the host's pid 1
        self.init_pid = None  # pid 1 of the host, as this machine sees it
        self.store = STORE_MOUNT
        self.node_dir = NODE_DIR
        self.killed = False

    # -- life -----------------------------------------------------------------------------
    def start(self):
        os.makedirs(self.cgroup, exist_ok=True)
        ready_read, ready_write = os.pipe()
        command = ["unshare", "--net", "--mount", "--pid", "--uts", "--fork", "--kill-child",
                   "--propagation", "private", "--mount-proc",
                   sys.executable, HOST_INIT, "--hostname", self.name,
                   "--store-source", self.cluster.store_dir, "--store-mount", STORE_MOUNT,
                   "--node-dir", NODE_DIR, "--hide", self.cluster.state_dir,
                   "--ready-fd", str(ready_write)] + [f"--keep={path}" for path in _image_paths_under_tmp()]
        self.init = subprocess.Popen(self._in_cgroup(command), pass_fds=(ready_write,),
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        os.close(ready_write)
        with os.fdopen(ready_read) as ready:
            line = ready.readline().strip()  # blocks until init has mounted everything (or died)
        if line != "ready":
            self.init.kill()
            raise HarnessError(f"host {self.name} did not start (init said {line!r}, "
                               f"exit {self.init.wait()})")
        # The init is the only child of `unshare --fork` (which exec'd from the cgroup wrapper).
        with open(f"/proc/{self.init.pid}/task/{self.init.pid}/children") as children:
            self.init_pid = int(children.read().split()[0])
        peer = f"{PREFIX}{self.cluster.tag}p{self.index}"
        _ip("link", "add", self.link, "type", "veth", "peer", "name", peer)
        _ip("link", "set", self.link, "master", self.cluster.bridge, "up")
        _ip("link", "set", peer, "netns", str(self.init_pid))
        for args in (["link", "set", peer, "name", "eth0"],
                     ["addr", "add", f"{self.address}/24", "dev", "eth0"],
                     ["link", "set", "eth0", "up"], ["link", "set", "lo", "up"]):
            self.run(["ip", *args])
        # A node forwards IPv4, as the operator guide asks of nodes that run jobs spanning hosts
        # with an isolated network (runtime/netns.py: their parts are routed through the node).
        self.run(["sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])
        return self

    def _in_cgroup(self, command):
        """Wraps a command so that it (and all it starts) runs in this host's freezer cgroup."""
        procs = os.path.join(self.cgroup, "cgroup.procs")
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *command]

    def _enter(self, command, cwd=None):
        return self._in_cgroup(["nsenter", "--target", str(self.init_pid), "--net", "--mount",
                                "--pid", "--uts", f"--wd={cwd or '/'}", "--", *command])

    # -- running things -------------------------------------------------------------------
    def popen(self, command, *, env=None, cwd=None, **kwargs):
        """Starts `command` in this host (its namespaces and cgroup); returns the Popen of the
        nsenter that waits for it (ending it ends the command, whose pid is host-local)."""
        if self.killed:
            raise HarnessError(f"host {self.name} was killed")
        return subprocess.Popen(self._enter(list(command), cwd), env=env, **kwargs)

    def run(self, command, *, env=None, cwd=None, timeout=120, check=True):
        """Runs `command` in this host; returns its CompletedProcess (text stdout/stderr)."""
        result = subprocess.run(self._enter(list(command), cwd), env=env, capture_output=True,
                                text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise HarnessError(f"{self.name}: {' '.join(command)} exited {result.returncode}\n"
                               f"{result.stdout}\n{result.stderr}")
        return result

    def python(self, code, **kwargs):
        """Runs a Python snippet in this host with the repository on sys.path."""
        env = dict(kwargs.pop("env", None) or os.environ)
        env["PYTHONPATH"] = self.cluster.repo_root
        return self.run([sys.executable, "-c", code], env=env, **kwargs)

    # -- faults -----------------------------------------------------------------------------
    def cut_network(self):
        """Takes the host off the network (its veth's bridge side down); processes go on."""
        _ip("link", "set", self.link, "down")

    def restore_network(self):
        _ip("link", "set", self.link, "up")

    def freeze(self):
        """Stops every process of the host (freezer cgroup) until thaw(); returns once frozen."""
        _freezer_write(self.cgroup, "FROZEN")
        deadline = time.monotonic() + 10
        while self.freezer_state() != "FROZEN":
            if time.monotonic() > deadline:
                raise HarnessError(f"{self.name} did not freeze: {self.freezer_state()}")
            time.sleep(0.01)

    def thaw(self):
        _freezer_write(self.cgroup, "THAWED")

    def freezer_state(self):
        with open(os.path.join(self.cgroup, "freezer.state")) as handle:
            return handle.read().strip()

    def kill(self):
        """Kills the host outright: every process (SIGKILL, also when frozen), its namespaces
        with them (the veth pair goes with its network namespace)."""
        self.killed = True
        # SIGKILL to the namespace's init kills every process in it; `unshare` (outside) then
        # reaps it and exits. Killing `unshare` first would leave the init to the machine's
        # own init to reap, which here takes seconds.
        if self.init_pid is not None:
            try:
                os.kill(self.init_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _freezer_write(self.cgroup, "THAWED")  # a frozen task dies only once thawed
        if self.init is not None:
            try:
                self.init.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.init.kill()
                self.init.wait()
        _kill_cgroup(self.cgroup)  # what is left outside the namespace: nsenter wrappers
        _ip("link", "delete", self.link, check=False)


class EmulatedHosts:
    """N emulated hosts on one bridge with one shared store (see the module docstring)."""

    def __init__(self, count, *, control_plane=False, repo_root=None):
        reason = skip_reason()
        if reason:
            raise HarnessError(reason)
        sweep_leftovers()
        self.tag = secrets.token_hex(2)
        while any(os.path.exists(os.path.join(root, self.tag)) for root in (STATE_ROOT, STORE_ROOT)):
            self.tag = secrets.token_hex(2)
        self.subnet = _free_subnet()
        self.bridge = f"{PREFIX}{self.tag}"
        self.state_dir = os.path.join(STATE_ROOT, self.tag)
        self.store_dir = os.path.join(STORE_ROOT, self.tag)  # the shared store, root side (see STORE_ROOT)
        self.repo_root = repo_root or os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))))
        self.control_plane_addr = f"{SUBNET_BASE}.{self.subnet}.1" if control_plane else None
        self.hosts = []
        os.makedirs(self.state_dir)
        os.makedirs(self.store_dir)
        os.chmod(self.store_dir, 0o1777)
        with open(os.path.join(self.state_dir, "owner"), "w") as handle:
            handle.write(str(os.getpid()))
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            if self.control_plane_addr:
                _ip("addr", "add", f"{self.control_plane_addr}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for index in range(count):
                self.hosts.append(Host(self, index).start())
        except BaseException:
            self.close()
            raise

    def __iter__(self):
        return iter(self.hosts)

    def __len__(self):
        return len(self.hosts)

    def __getitem__(self, index):
        return self.hosts[index]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Kills every host and removes the bridge, veths, cgroups and folders; idempotent."""
        for host in self.hosts:
            try:
                host.kill()
            except HarnessError:
                pass
        _teardown_tag(self.tag)
