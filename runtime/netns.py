"""A job's own network namespace: loopback only (issue 13, SandboxSpec.network "isolated").

Why: a rank on the node's network reaches every service the node listens on, its loopback ones
too: on an all-in-one node PostgreSQL (trust auth), Redis (the Celery broker: a queued task runs in
a worker), the control plane's own port; on any node every address the node can reach.

Where: the launcher calls `enter_isolated_network` first of all (runtime/sandbox.py
LaunchSandbox.enter, right after it joined the job's cgroup), while it is its process's only
thread: a namespace belongs to a thread, and every thread and process started after it (the
rendezvous store, the ranks, a CRIU it runs) inherits it. So the launcher and its ranks share one
namespace with one loopback: the rendezvous store on 127.0.0.1 and gloo between the ranks work as
before, and nothing outside the namespace is reachable (there is no other interface, no route).
What still crosses is the file system: the job's files, and the control socket (runtime/control.py),
a unix socket bound to a path, which no network namespace scopes. (Abstract unix socket names are
scoped, so the node's abstract sockets are out of the job's reach too.)

A job spanning hosts keeps the node's network (its ranks and rendezvous talk TCP across hosts):
giving it a namespace that reaches only its peers' namespaces needs a veth pair per job and routes
or NAT between hosts, which this project's machines (no iptables, no nft) cannot build here.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import threading

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
