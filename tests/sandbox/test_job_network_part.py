"""One host's part of a job network across hosts (runtime/netns.py JobNetworkPart), on a node played
by a network namespace of its own (tests/sandbox/scripts/job_network_node.py under `unshare --net`):
what the job sees, what the node holds, a second job with the same address refused by name without
harm to the first, and what leave() removes. Across real (emulated) hosts:
tests/hosts/test_multihost_criu.py and test_multihost_cut.py."""
import json
import os
import subprocess
import sys

import pytest

from protocol.launch import job_part_addresses
from runtime import netns

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NODE = os.path.join(REPO, "tests", "sandbox", "scripts", "job_network_node.py")
LOCAL, REMOTE = job_part_addresses(job_id=7, nodes=2)
NODE_LINK = netns.node_link_name(LOCAL)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and links need root")


@pytest.fixture(scope="module")
def seen():
    result = subprocess.run(["unshare", "--net", sys.executable, NODE], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": REPO}, cwd=REPO)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_job_sees_loopback_and_its_link_and_routes_to_its_other_part_only(seen):
    part = seen["part"]
    assert part["links"] == ["job0", "lo"]
    assert part["addresses"] == [f"{LOCAL}/32", "127.0.0.1/8", "::1/128"]  # no IPv6 link-local on job0
    assert part["routes"] == [REMOTE]  # no default route
    # The node's own address and any other: no route (101 ENETUNREACH); its loopback is its own (111).
    assert part["reaches"] == {"10.99.0.1": 101, "127.0.0.1": 111, "10.0.0.1": 101}


def test_the_node_routes_the_part_through_an_addressless_link_and_the_other_part_through_its_host(seen):
    node = seen["node_while_running"]
    assert NODE_LINK in node["links"]
    assert node["node_link_addresses"] == []  # neither IPv4 nor IPv6: no way into the node's services
    assert node["routes"] == [f"unicast {LOCAL} {NODE_LINK}", f"unicast {REMOTE} 10.99.0.2",
                              "unreachable 100.64.0.0/10 "]


def test_a_second_job_with_the_same_address_on_the_node_is_refused_by_name_and_harms_nothing(seen):
    assert "the job address 100.64.1.192 is in use by another job on this node" in seen["second_part"]["error"]
    assert seen["node_after_refusal"] == seen["node_while_running"]  # its leave() left the first's link alone


def test_leave_removes_the_parts_link_and_routes_and_keeps_the_ranges_fence(seen):
    node = seen["node_after_leave"]
    assert NODE_LINK not in node["links"]
    assert node["routes"] == ["unreachable 100.64.0.0/10 "]
