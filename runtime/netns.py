"""A job's own network namespace (issue 13, SandboxSpec.network "isolated"): loopback only on one
host; on several hosts loopback plus one address, routed only to the job's other hosts' parts.

Why: a rank on the node's network reaches every service the node listens on, its loopback ones
too: on an all-in-one node PostgreSQL (trust auth), Redis (the Celery broker: a queued task runs in
a worker), the control plane's own port; on any node every address the node can reach.

Where: the launcher calls `enter_isolated_network` (one host) or `JobNetworkPart.enter` (several)
first of all (runtime/sandbox.py LaunchSandbox.enter, right after it joined the job's cgroup), while
it is its process's only thread: a namespace belongs to a thread, and every thread and process
started after it (the rendezvous store, the ranks, a CRIU it runs) inherits it. So the launcher and
its ranks share one namespace: the rendezvous store and gloo between the ranks work as before, and
nothing else is reachable. What still crosses is the file system: the job's files, and the control
socket (runtime/control.py), a unix socket bound to a path, which no network namespace scopes.
(Abstract unix socket names are scoped, so the node's abstract sockets are out of the job's reach too.)

A job spanning hosts (JobNetworkPart): a ROUTED design, no NAT and no packet filter (these machines
have neither iptables nor nft). Each host's part of the job gets a namespace with `lo` and `job0`,
one end of a veth pair whose other end (`mj<offset>`) stays in the node's namespace WITHOUT an
address (an address there would be a way into every service the node listens on 0.0.0.0), and
one address of the job's block (protocol.launch.job_part_addresses, given by the agent in the
spec). Inside: a /32 route to each other part's address `dev job0`, and nothing else: no default
route, so the node's addresses, its loopback, the other hosts and the control plane are
unreachable (ENETUNREACH), and the job's uid has no CAP_NET_ADMIN there to add a route. On the
node: a /32 route to the local part via its veth, one to each remote part via that host's node
address (published by its launcher in the rendezvous folder: runtime/rendezvous.py
FolderRendezvous.publish_node), `unreachable 100.64.0.0/10` behind them (a peer not up yet is not
forwarded by the node's own default route), and the node must forward IPv4
(net.ipv4.ip_forward=1: refused by name otherwise; the launcher does not change a node's
settings). Neighbours are static on both ends (the veth's peer MAC, `nud permanent`), so neither
end answers or needs ARP (no proxy_arp), and IPv6 is off on both ends (a link-local address on the
node's end would be reachable from the job). rp_filter, strict or loose, passes the forwarded
packets: each source's route points back out of the interface it came in on.

Collisions: each address a launcher routes on its node (its own part's and each remote part's) is
claimed by an abstract unix socket bound in the node's namespace (`claim_address`): it lives
exactly as long as the launcher, needs no file, and is per node because abstract names are per
network namespace. A claim already held is another live job using the same address on this node
(two job ids equal modulo the block count): the launch is refused by name. A crashed launcher's
leftovers are harmless and swept by the next user of the address: its veth dies with its
namespace, its routes point 100.64/10 addresses (which only job namespaces use) at hosts, and the
next launcher that claims the address replaces them (`ip route replace`, an old `mj` link deleted).

CRIU (runtime/criu.py): the namespace is the launcher's, never dumped; ranks restored on other
hosts join the restoring launcher's new namespace, whose address is the same part's (the address
depends on the job and the host's place in it, not on the host), and the virtual group rebuilds its
TCP links after the restore from MERIDIAN_NODE_ADDR, which the launcher sets to its part's address.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import json
import os
import socket
import struct
import subprocess
import threading
import time

from protocol.launch import JOB_NETWORK_RANGE

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
IFREQ_FLAGS = "16sH22x"  # struct ifreq (40 bytes): the interface's name, then ifr_flags in the union
LOOPBACK = "lo"


class NetworkNamespaceError(RuntimeError):
    """The job's network namespace cannot be made; the message says why."""


def enter_isolated_network() -> None:
    """Moves the calling process into a new network namespace and brings its loopback up. Raises
    NetworkNamespaceError when another thread runs (it would stay on the node's network) or when the
    kernel refuses (no CAP_SYS_ADMIN: the launcher is not root)."""
    if threading.active_count() != 1:
        raise NetworkNamespaceError(f"{threading.active_count()} threads run: a network namespace is a thread's, "
                                    "so it must be entered before any other thread starts")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        raise NetworkNamespaceError(f"unshare(CLONE_NEWNET): {os.strerror(code)} (the launcher must run as root)")
    try:
        loopback_up()
    except OSError as exc:
        raise NetworkNamespaceError(f"the namespace's loopback cannot be brought up: {exc}") from None


def loopback_up() -> None:
    """Sets IFF_UP on this namespace's `lo` (a new namespace's loopback starts down): the ioctl `ip
    link set lo up` makes, without starting a process."""
    name = LOOPBACK.encode()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        answer = fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, struct.pack(IFREQ_FLAGS, name, 0))
        flags = struct.unpack(IFREQ_FLAGS, answer)[1]
        fcntl.ioctl(sock.fileno(), SIOCSIFFLAGS, struct.pack(IFREQ_FLAGS, name, flags | IFF_UP))


def namespace_id(pid: int | str = "self") -> str:
    """Returns the network namespace of process `pid` as the kernel names it ("net:[4026531840]")."""
    return os.readlink(f"/proc/{pid}/ns/net")


# -- a job spanning hosts: JobNetworkPart ----------------------------------------------------------
JOB_LINK = "job0"  # the job's end of its veth pair, in its namespace
NODE_LINK_PREFIX = "mj"  # the node's end: mj + the address's offset in the job range, 6 hex digits
ROUTE_PROTO = "180"  # the routing protocol number Meridian's node routes carry (ip route ... proto)
CLAIM_PREFIX = "meridian-job-address-"  # abstract unix socket names: a node's claims of job addresses
IP_FORWARD = "/proc/sys/net/ipv4/ip_forward"
PEERS_POLL_S = 0.05


def _ip(*args: str) -> str:
    """Runs `ip ARGS` in the calling thread's network namespace; returns its output. Raises
    NetworkNamespaceError with ip's own words when it fails."""
    try:
        result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetworkNamespaceError(f"`ip {' '.join(args)}`: {exc}") from None
    if result.returncode != 0:
        raise NetworkNamespaceError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    return result.stdout


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise NetworkNamespaceError(f"setns: {os.strerror(ctypes.get_errno())}")


@contextlib.contextmanager
def _in_namespace(fd: int, back_fd: int):
    """Runs the block with the calling thread in namespace `fd`, then moves it back to `back_fd`.
    A network namespace is a thread's (setns moves only the caller, allowed with other threads
    running), and a process the block starts inherits it."""
    _setns(fd)
    try:
        yield
    finally:
        _setns(back_fd)


def _link_mac(name: str) -> str:
    (link,) = json.loads(_ip("-j", "link", "show", "dev", name))
    return link["address"]


def _ipv6_off(link: str) -> None:
    """Turns IPv6 off on `link` of the calling thread's namespace (no link-local address: nothing
    on the other end can be reached over IPv6); a kernel without IPv6 has nothing to turn off."""
    path = f"/proc/sys/net/ipv6/conf/{link}/disable_ipv6"
    if os.path.exists(path):
        with open(path, "w") as handle:
            handle.write("1")


def node_forwards() -> bool:
    """Returns whether the calling thread's network namespace forwards IPv4 (net.ipv4.ip_forward)."""
    try:
        with open(IP_FORWARD) as handle:
            return handle.read().strip() == "1"
    except OSError:
        return False


def claim_address(address: str) -> socket.socket:
    """Returns a socket that holds this network namespace's claim of job address `address` until it
    is closed (or its process dies). Raises NetworkNamespaceError when a live process already holds
    it: another job uses the address on this node."""
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(f"\0{CLAIM_PREFIX}{address}")
    except OSError as exc:
        claim.close()
        raise NetworkNamespaceError(
            f"the job address {address} is in use by another job on this node ({exc.strerror}): two live jobs "
            "spanning hosts whose ids are equal modulo the job blocks met on this node") from None
    return claim


def node_link_name(address: str) -> str:
    """Returns the name of the node's end of the veth of the part at `address` ("mj" + 6 hex digits)."""
    offset = int(ipaddress.IPv4Address(address)) - int(JOB_NETWORK_RANGE.network_address)
    return f"{NODE_LINK_PREFIX}{offset:06x}"


class JobNetworkPart:
    """This host's part of the network of a job spanning hosts (see the module docstring):
    `enter` makes it and moves the caller into it; `link_peers` routes the other hosts' parts once
    their launchers published their node addresses; `leave` removes what the node holds for it."""

    def __init__(self, *, addresses, node_rank: int):
        self.addresses = tuple(addresses)
        self.node_rank = node_rank
        self.address = self.addresses[node_rank]
        self.node_link = node_link_name(self.address)
        self._node_fd: int | None = None
        self._job_fd: int | None = None
        self._claims: dict[str, socket.socket] = {}
        self._remote_routes: list[str] = []
        self._made_link = False  # the node's end is ours to delete (never before our claim held)

    def enter(self) -> None:
        """Makes the part's namespace and veth, routes it on the node, and leaves the calling
        process in the namespace. Call while the process has one thread (as enter_isolated_network).
        Raises NetworkNamespaceError: the node does not forward, the address is another job's here,
        the kernel or `ip` refuses."""
        if threading.active_count() != 1:
            raise NetworkNamespaceError(f"{threading.active_count()} threads run: a network namespace is a "
                                        "thread's, so it must be entered before any other thread starts")
        if not node_forwards():
            raise NetworkNamespaceError(
                "this node does not forward IPv4 (net.ipv4.ip_forward is not 1): a job spanning hosts with an "
                "isolated network is routed through the node (docs/operator-guide.md)")
        self._node_fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._claims[self.address] = claim_address(self.address)
        # A link of the same name is a crashed launcher's whose namespace still lives (or is being
        # destroyed): the address is ours now (claimed), so its leftovers go.
        subprocess.run(["ip", "link", "del", self.node_link], capture_output=True, timeout=30)
        # The job's end gets its name JOB_LINK only inside its namespace: two launchers making their
        # pairs at once on one node would both want it in the node's.
        moving = f"{NODE_LINK_PREFIX}t{self.node_link[len(NODE_LINK_PREFIX):]}"
        _ip("link", "add", self.node_link, "type", "veth", "peer", "name", moving)
        self._made_link = True
        _ipv6_off(self.node_link)
        node_mac = _link_mac(self.node_link)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWNET) != 0:
            raise NetworkNamespaceError(f"unshare(CLONE_NEWNET): {os.strerror(ctypes.get_errno())} "
                                        "(the launcher must run as root)")
        self._job_fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        loopback_up()
        with _in_namespace(self._node_fd, self._job_fd):
            _ip("link", "set", moving, "netns", f"/proc/{os.getpid()}/fd/{self._job_fd}")
        _ip("link", "set", moving, "name", JOB_LINK)
        _ipv6_off(JOB_LINK)
        job_mac = _link_mac(JOB_LINK)
        _ip("address", "add", f"{self.address}/32", "dev", JOB_LINK)
        _ip("link", "set", JOB_LINK, "up")
        for peer in self.addresses:
            if peer != self.address:
                _ip("neigh", "replace", peer, "lladdr", node_mac, "dev", JOB_LINK, "nud", "permanent")
                _ip("route", "add", f"{peer}/32", "dev", JOB_LINK, "src", self.address)
        with _in_namespace(self._node_fd, self._job_fd):
            _ip("link", "set", self.node_link, "up")
            _ip("neigh", "replace", self.address, "lladdr", job_mac, "dev", self.node_link, "nud", "permanent")
            _ip("route", "replace", f"{self.address}/32", "dev", self.node_link, "proto", ROUTE_PROTO)
            # Behind every job route: an address of the range that is not routed (a peer not up yet)
            # is dropped here, not forwarded by the node's default route. Made once per node.
            subprocess.run(["ip", "route", "add", "unreachable", str(JOB_NETWORK_RANGE), "proto", ROUTE_PROTO],
                           capture_output=True, timeout=30)

    def link_peers(self, node_addresses: dict[int, str], *, own_node_addr: str) -> None:
        """Routes each other part's address (node rank -> that host's node address) on this node
        via that host, claiming it first. A part whose host is this node (a test's colocated
        launchers: the same node address) is routed by its own launcher and left alone."""
        assert self._node_fd is not None and self._job_fd is not None
        with _in_namespace(self._node_fd, self._job_fd):
            for node_rank, address in enumerate(self.addresses):
                if node_rank == self.node_rank or node_addresses[node_rank] == own_node_addr:
                    continue
                self._claims[address] = claim_address(address)
                _ip("route", "replace", f"{address}/32", "via", node_addresses[node_rank], "proto", ROUTE_PROTO)
                self._remote_routes.append(address)

    def leave(self) -> None:
        """Removes the node's routes to the other parts and this part's veth (its namespace's
        processes, if any are left, lose the network), then gives the claims up. Idempotent; the
        caller stays in the namespace it is in. Also after an `enter` that failed half way."""
        if self._node_fd is None:
            return
        if self._job_fd is None:  # enter failed before its unshare: the caller is still on the node's
            if self._made_link:  # (a failed claim made none: a link of that name is the other job's)
                subprocess.run(["ip", "link", "del", self.node_link], capture_output=True, timeout=30)
        else:
            self._leave_node_side()
        for claim in self._claims.values():
            claim.close()
        self._claims = {}

    def _leave_node_side(self) -> None:
        assert self._node_fd is not None and self._job_fd is not None
        with _in_namespace(self._node_fd, self._job_fd):
            for address in self._remote_routes:
                subprocess.run(["ip", "route", "del", f"{address}/32", "proto", ROUTE_PROTO],
                               capture_output=True, timeout=30)
            subprocess.run(["ip", "link", "del", self.node_link], capture_output=True, timeout=30)
        self._remote_routes = []


def wait_peer_node_addresses(read, *, nodes: int, timeout_s: float) -> dict[int, str]:
    """Polls `read()` ({node rank: node address} published so far) until every one of `nodes` is
    there; returns it. Raises NetworkNamespaceError naming the missing ones after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = read()
        if len(found) >= nodes:
            return found
        if time.monotonic() >= deadline:
            missing = sorted(set(range(nodes)) - set(found))
            raise NetworkNamespaceError(f"hosts {missing} of the job never published their node address within "
                                        f"{timeout_s:.0f} s")
        time.sleep(PEERS_POLL_S)
