"""The emulated hosts share nothing but each other's addresses and the store (tests/hosts/emulated_hosts.py)."""
import os
import subprocess
import sys
import time

import emulated_hosts as harness
import pytest
from polling import poll

SERVE = """
import socket, sys
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], 0))
server.listen()
print(server.getsockname()[1], flush=True)
while True:
    connection, _ = server.accept()
    connection.sendall(b"hello from " + socket.gethostname().encode())
    connection.close()
"""

CONNECT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2) as connection:
        print("got", connection.recv(100).decode())
except OSError as exc:
    print("refused", type(exc).__name__, exc)
"""


def serve(host, bind):
    """Starts a TCP server in `host` on `bind`; returns (process, port)."""
    process = host.popen([sys.executable, "-c", SERVE, bind], stdout=subprocess.PIPE, text=True)
    return process, int(process.stdout.readline())


def connect(host, addr, port):
    return host.run([sys.executable, "-c", CONNECT, addr, str(port)]).stdout.strip()


def test_a_host_cannot_see_another_hosts_shared_memory_or_tmp(emulated_hosts):
    a, b = emulated_hosts(2)
    b.run(["sh", "-c", "echo b > /dev/shm/only-b && echo b > /tmp/only-b && echo b > /run/meridian-node/only-b"])
    assert b.run(["cat", "/dev/shm/only-b"]).stdout == "b\n"
    for path in ("/dev/shm/only-b", "/tmp/only-b", "/run/meridian-node/only-b"):
        assert a.run(["test", "-e", path], check=False).returncode == 1, path
        assert not os.path.exists(path), f"{path} leaked to the real machine"


def test_a_host_sees_only_its_own_processes(emulated_hosts):
    a, b = emulated_hosts(2)
    sleeper = b.popen(["sleep", "1000"])
    try:
        poll("the sleep to run in host b", lambda: "sleep" in b.run(["sh", "-c", "cat /proc/[0-9]*/comm"]).stdout,
             timeout=20)
        assert "sleep" not in a.run(["sh", "-c", "cat /proc/[0-9]*/comm"]).stdout
        assert a.run(["sh", "-c", "cat /proc/1/cmdline"]).stdout.count("host_init.py") == 1
    finally:
        sleeper.kill()


def test_hosts_reach_each_other_by_address_but_not_each_others_loopback(emulated_hosts):
    a, b = emulated_hosts(2)
    local, local_port = serve(b, "127.0.0.1")
    public, public_port = serve(b, b.address)
    try:
        assert connect(b, "127.0.0.1", local_port) == "got hello from mh-1"  # the server is up
        assert connect(a, "127.0.0.1", local_port).startswith("refused")
        assert connect(a, b.address, public_port) == "got hello from mh-1"
    finally:
        local.kill()
        public.kill()


ISOLATED_CONNECT = """
import socket, sys
from runtime import netns
netns.enter_isolated_network()  # what a sandboxed job's launcher does first (runtime/netns.py)
server = socket.create_server(("127.0.0.1", 0))
with socket.create_connection(server.getsockname(), timeout=2):
    print("own loopback: up")
""" + CONNECT


def test_a_jobs_network_namespace_nests_inside_a_host_and_reaches_neither_its_peers_nor_its_host(emulated_hosts):
    """An agent in an emulated host (or a container) is already in a network namespace: the job's
    is made from inside it, with a loopback of its own, and reaches nothing of the host's network."""
    a, b = emulated_hosts(2)
    public, public_port = serve(b, b.address)
    local, local_port = serve(a, "127.0.0.1")
    try:
        assert connect(a, b.address, public_port) == "got hello from mh-1"  # the host itself reaches b
        assert connect(a, "127.0.0.1", local_port) == "got hello from mh-0"  # and its own loopback service
        env = {**os.environ, "PYTHONPATH": a.cluster.repo_root}

        def isolated_connect(addr, port):
            return a.run([sys.executable, "-c", ISOLATED_CONNECT, addr, str(port)], env=env).stdout.split("\n")

        lines = isolated_connect(b.address, public_port)
        assert lines[0] == "own loopback: up" and lines[1].startswith("refused"), lines
        lines = isolated_connect("127.0.0.1", local_port)
        assert lines[1].startswith("refused"), lines  # not the host's loopback services either
    finally:
        public.kill()
        local.kill()


def test_a_host_reaches_nothing_but_the_hosts(emulated_hosts):
    hosts = emulated_hosts(2)
    machine = subprocess.run(["ip", "-o", "-4", "addr", "show", "scope", "global"], capture_output=True,
                             text=True, check=True).stdout.split()
    outside = [word.split("/")[0] for i, word in enumerate(machine) if machine[i - 1] == "inet"
               and not word.startswith(harness.SUBNET_BASE)]
    assert outside, "this machine has no address outside the harness to try"
    routes = hosts[0].run(["ip", "-o", "route"]).stdout
    assert "default" not in routes
    for addr in outside:
        assert connect(hosts[0], addr, 22).startswith("refused"), addr
    links = hosts[0].run(["ip", "-o", "link"]).stdout
    assert sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines()) == ["eth0", "lo"]


def test_hosts_share_the_store(emulated_hosts):
    a, b = emulated_hosts(2)
    a.run(["sh", "-c", f"echo from-a > {a.store}/shared"])
    assert b.run(["cat", f"{b.store}/shared"]).stdout == "from-a\n"
    assert a.run(["test", "-e", f"{a.store}/../meridian-node"]).returncode == 0
    # the harness's own folder (with the other hosts' state) is hidden from the hosts
    assert a.run(["ls", "-A", hosts_state_dir(a)]).stdout == ""


def hosts_state_dir(host):
    return host.cluster.state_dir


def test_cutting_a_hosts_network_and_restoring_it(emulated_hosts):
    a, b = emulated_hosts(2)
    server, port = serve(b, b.address)
    try:
        b.cut_network()
        assert connect(a, b.address, port).startswith("refused")
        b.restore_network()
        deadline = time.monotonic() + 10
        while (answer := connect(a, b.address, port)) != "got hello from mh-1":
            assert time.monotonic() < deadline, answer
    finally:
        server.kill()


def test_freezing_a_host_stops_its_processes_until_thawed(emulated_hosts):
    (a,) = emulated_hosts(1)
    ticker = a.popen(["sh", "-c", "while true; do date +%s%N > /dev/shm/tick; sleep 0.05; done"])

    def tick():
        return a.run(["cat", "/dev/shm/tick"], check=False).stdout

    try:
        deadline = time.monotonic() + 10
        while not tick():
            assert time.monotonic() < deadline
        a.freeze()
        frozen_at = open(f"/proc/{a.init_pid}/root/dev/shm/tick").read()
        time.sleep(0.5)  # long enough for ten ticks, were it running
        assert open(f"/proc/{a.init_pid}/root/dev/shm/tick").read() == frozen_at
        a.thaw()
        deadline = time.monotonic() + 10
        while tick() == frozen_at:
            assert time.monotonic() < deadline, "the host did not go on after thaw"
    finally:
        ticker.kill()


def test_killing_a_host_ends_its_processes_and_its_link(emulated_hosts):
    a, b = emulated_hosts(2)
    sleeper = b.popen(["sleep", "1000"])
    init_pid = b.init_pid
    b.freeze()  # a frozen host can be killed too
    b.kill()
    assert sleeper.wait(timeout=10) != 0
    assert not harness.process_running(init_pid)
    assert b.link not in harness._links()
    with pytest.raises(harness.HarnessError):
        b.popen(["true"])
    assert a.run(["hostname"]).stdout == "mh-0\n"


def test_close_removes_everything_and_a_sweep_removes_what_a_dead_harness_left(emulated_hosts):
    cluster = harness.EmulatedHosts(2)
    tag, pids = cluster.tag, [host.init_pid for host in cluster]
    cluster.close()
    assert not [link for link in harness._links() if link.startswith(harness.PREFIX + tag)]
    assert not os.path.exists(cluster.state_dir) and not os.path.exists(cluster.store_dir)
    assert not [name for name in os.listdir(harness.FREEZER_ROOT) if name.startswith(harness.PREFIX + tag)]
    assert not [pid for pid in pids if harness.process_running(pid)]

    left = harness.EmulatedHosts(1)  # its owner "dies": a pid that does not exist
    with open(os.path.join(left.state_dir, "owner"), "w") as handle:
        handle.write(str(2 ** 22 + 1))
    assert left.tag in harness.sweep_leftovers()
    assert not [link for link in harness._links() if link.startswith(harness.PREFIX + left.tag)]
    assert not harness.process_running(left[0].init_pid)
    assert not os.path.exists(left.state_dir) and not os.path.exists(left.store_dir)
