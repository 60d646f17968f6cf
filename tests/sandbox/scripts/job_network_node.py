"""Plays a node for runtime/netns.py JobNetworkPart in the network namespace it is started in (run it
under `unshare --net`: nothing of the machine's is touched). Prints one JSON object: what a part of
job 7 over 2 hosts (node rank 0; the other host at 10.99.0.2) sees inside, what the node holds for
it, what a second part claiming the same addresses on this node gets, and what is left after leave().
"""
import json
import os
import socket
import subprocess
import sys

from protocol.launch import job_part_addresses
from runtime import netns

ADDRESSES = job_part_addresses(job_id=7, nodes=2)
NODE_ADDR, OTHER_HOST = "10.99.0.1", "10.99.0.2"


def ip_json(*args):
    return json.loads(subprocess.run(["ip", "-j", *args], check=True, capture_output=True, text=True).stdout or "[]")


def node_view():
    links = {link["ifname"]: link for link in ip_json("addr")}
    routes = ip_json("route", "show", "proto", netns.ROUTE_PROTO)
    return {"links": sorted(links), "node_link_addresses": [a["family"] for a in
                                                           links.get(netns.node_link_name(ADDRESSES[0]), {}).get(
                                                               "addr_info", [])],
            "routes": sorted(f"{r.get('type', 'unicast')} {r['dst']} {r.get('gateway') or r.get('dev', '')}"
                             for r in routes)}


def part(report_fd, go_fd):
    """A launcher's part: enter, say what it sees, link the other host, wait, leave."""
    view = {}
    network = netns.JobNetworkPart(addresses=ADDRESSES, node_rank=0)
    try:
        network.enter()
        network.link_peers({0: NODE_ADDR, 1: OTHER_HOST}, own_node_addr=NODE_ADDR)
        view["links"] = sorted(link["ifname"] for link in ip_json("link"))
        view["addresses"] = sorted(f"{a['local']}/{a['prefixlen']}" for link in ip_json("addr")
                                   for a in link.get("addr_info", []))
        view["routes"] = sorted(r["dst"] for r in ip_json("route"))
        reaches = {}
        for target in (NODE_ADDR, "127.0.0.1", "10.0.0.1"):
            try:
                socket.create_connection((target, 9), timeout=2).close()
                reaches[target] = "connected"
            except OSError as exc:
                reaches[target] = exc.errno
        view["reaches"] = reaches
    except netns.NetworkNamespaceError as exc:
        view["error"] = str(exc)
    os.write(report_fd, json.dumps(view).encode() + b"\n")
    os.read(go_fd, 1)
    network.leave()  # also after a refused enter, as LaunchSandbox.enter does: it must not touch the other's
    os._exit(0)


def start_part():
    report_read, report_write = os.pipe()
    go_read, go_write = os.pipe()
    if os.fork() == 0:
        part(report_write, go_read)
    with os.fdopen(report_read) as report:
        return json.loads(report.readline()), go_write


def main():
    with open(netns.IP_FORWARD, "w") as handle:
        handle.write("1")
    netns.loopback_up()
    for args in (["link", "add", "wire0", "type", "veth", "peer", "name", "wire1"],
                 ["addr", "add", f"{NODE_ADDR}/24", "dev", "wire0"], ["link", "set", "wire0", "up"],
                 ["link", "set", "wire1", "up"]):
        subprocess.run(["ip", *args], check=True)
    result = {}
    result["part"], go_first = start_part()
    result["node_while_running"] = node_view()
    result["second_part"], go_second = start_part()  # the same addresses: another job, on this node
    os.write(go_second, b"1")
    os.wait()
    result["node_after_refusal"] = node_view()
    os.write(go_first, b"1")
    os.wait()
    result["node_after_leave"] = node_view()
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
