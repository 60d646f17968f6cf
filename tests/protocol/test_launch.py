"""Launcher <-> agent messages: the event log, progress.json, the control requests and their answers."""
import ipaddress
import json

import pytest

from protocol import ProtocolError
from protocol.cut import DeviceMap
from protocol.launch import (
    JOB_NETWORK_BLOCKS,
    JOB_NETWORK_HOSTS,
    JOB_NETWORK_RANGE,
    NETWORK_SPANS_HOSTS,
    CheckpointAnswer,
    CheckpointSeconds,
    CheckpointTaken,
    CommandFailed,
    ControlFailure,
    Failed,
    Finished,
    LastCheckpoint,
    Progress,
    ProgressRequest,
    ResizeAnswer,
    Resized,
    ResizeRequest,
    Restored,
    SandboxSpec,
    Started,
    Stopped,
    StopRequest,
    control_answer_from_dict,
    control_request_from_dict,
    event_from_dict,
    event_line,
    job_part_addresses,
    parse_events,
)
from protocol.rendezvous import NodeAddress
from protocol.states import JobNetwork

MAP = DeviceMap.from_dict({"devices": {"0": [0], "1": [1]}, "ranks": {"0": 0, "1": 1}})
SECONDS = CheckpointSeconds(cut=0.1, dump=0.2, commit=0.3, total=0.6)
EVENTS = [
    Started(time_unix=1.0, engine="criu", world_size=2, devices=2, reason="requested", device_indices=(3, 5)),
    Restored(time_unix=2.0, engine="criu", step=4, checkpoint="file:///c", spool="/run/meridian/j", seconds=0.5),
    CheckpointTaken(time_unix=3.0, engine="framework", step=8, checkpoint="file:///c2", bytes=10, action="stop",
                    seconds=SECONDS),
    Resized(time_unix=4.0, engine="criu", step=9, devices=2, device_map=MAP, seconds=0.1, device_indices=(1, 2)),
    Stopped(time_unix=5.0, engine="criu", step=8, checkpoint="file:///c2"),
    Finished(time_unix=6.0, engine="criu", step=None),
    Failed(time_unix=7.0, engine=None, error="rank 0 exited with code 1"),
    CommandFailed(time_unix=8.0, engine="criu", event="resize_failed", error="resize failed: rank 0: x"),
]


@pytest.mark.parametrize("event", EVENTS, ids=[event.event for event in EVENTS])
def test_each_event_round_trips_through_its_line(event):
    line = event_line(event)
    assert line.endswith("\n") and "\n" not in line[:-1]
    assert event_from_dict(json.loads(line)) == event


def test_the_log_is_read_in_order_and_a_torn_last_line_is_skipped():
    text = "".join(event_line(event) for event in EVENTS) + '{"event": "finished", "time_un'
    assert parse_events(text) == EVENTS


def test_an_unknown_or_malformed_record_is_skipped_by_the_reader_and_named_by_the_decoder():
    text = '{"event": "teleported", "time_unix": 1}\n{"event": "stopped", "time_unix": 1, "step": -1}\n'
    assert parse_events(text) == []
    with pytest.raises(ProtocolError) as caught:
        event_from_dict({"event": "teleported", "time_unix": 1})
    assert caught.value.field == "event"


def test_an_event_of_a_launcher_without_the_newer_fields_still_reads():
    old = {"time_unix": 1.0, "event": "started", "engine": "criu", "world_size": 2, "devices": 2, "reason": "r"}
    assert event_from_dict(old).device_indices is None


def test_progress_round_trips():
    progress = Progress(job_id="j", state="running", engine="criu", engine_reason="auto", step=3,
                        steps_per_s=2.5, world_size=2, devices=2, device_map=MAP, device_indices=(0, 1),
                        last_checkpoint=LastCheckpoint(step=2, uri="file:///c", engine="criu", bytes=5),
                        updated_unix=9.0, rank_pids=(11, 12), spool="/run/meridian/j")
    wire = progress.to_dict()
    assert wire["device_map"] == {"devices": {"0": [0], "1": [1]}, "ranks": {"0": 0, "1": 1}}
    assert Progress.from_dict(wire) == progress


def test_control_requests_decode_by_command():
    assert control_request_from_dict({"cmd": "progress"}) == ProgressRequest()
    assert control_request_from_dict({"cmd": "stop", "at_step": 5}) == StopRequest(at_step=5)
    assert control_request_from_dict({"cmd": "resize", "devices": 2, "device_indices": [0, 3]}) == \
        ResizeRequest(devices=2, device_indices=(0, 3))


@pytest.mark.parametrize("obj, field", [
    ({"cmd": "explode"}, "cmd"),
    ({}, "cmd"),
    ({"cmd": "resize"}, "devices"),
    ({"cmd": "resize", "devices": 2, "device_indices": [1]}, "device_indices"),
    ({"cmd": "resize", "devices": 2, "device_indices": [1, 1]}, "device_indices"),
    ({"cmd": "checkpoint", "timeout_s": -1}, "timeout_s"),
    ({"cmd": "stop", "at_step": "soon"}, "at_step"),
], ids=["unknown", "no-cmd", "resize-without-devices", "indices-for-other-count", "index-twice",
        "negative-timeout", "string-step"])
def test_a_malformed_control_request_is_refused_by_field(obj, field):
    with pytest.raises(ProtocolError) as caught:
        control_request_from_dict(obj)
    assert caught.value.field == field


def test_answers_decode_by_command_and_a_failure_as_such():
    answer = CheckpointAnswer(step=3, engine="criu", checkpoint="file:///c", bytes=1, seconds=SECONDS)
    assert control_answer_from_dict("stop", answer.to_dict()) == answer
    resized = ResizeAnswer(step=3, devices=2, device_map=MAP, seconds=0.2)
    assert control_answer_from_dict("resize", resized.to_dict()) == resized
    assert control_answer_from_dict("checkpoint", {"ok": False, "error": "refused"}) == ControlFailure(error="refused")


# -- sandbox.json: the job's network (issue 13) ------------------------------------------------------
def test_a_sandbox_spec_carries_its_network_and_round_trips():
    spec = SandboxSpec(uid=1_000_007, gid=1_000_007, cgroup_version="v2", cgroup_dirs=("/sys/fs/cgroup/m/j7",),
                       network=JobNetwork.ISOLATED)
    wire = json.loads(json.dumps(spec.to_dict()))
    assert (wire["v"], wire["network"]) == (2, "isolated")
    assert SandboxSpec.from_dict(wire) == spec
    assert "network: isolated" in spec.describe()


@pytest.mark.parametrize("network", ["none", "", "ISOLATED", 1, ["host"]])
def test_a_sandbox_spec_with_an_unknown_network_is_refused_by_field(network):
    with pytest.raises(ProtocolError) as refused:
        SandboxSpec.from_dict({"v": 2, "uid": 1_000_007, "network": network})
    assert refused.value.field == "network"


def test_a_spec_of_an_agent_that_predates_the_field_reads_as_the_host_network_it_had():
    old = {"v": 1, "uid": 1_000_007, "gid": 1_000_007}  # what such an agent wrote
    assert SandboxSpec.from_dict(old).network == JobNetwork.HOST


def test_a_launcher_that_predates_the_field_refuses_the_spec_rather_than_run_on_the_host_network():
    """Such a launcher reads sandbox.json with version 1 of the type (unknown keys ignored): the
    version makes it refuse, so its launch fails saying why instead of running an isolated job on
    the node's network."""

    class SandboxSpecVersion1(SandboxSpec):  # what it decodes with: the same fields it knows, version 1
        VERSION = 1

    wire = SandboxSpec(uid=1_000_007, network=JobNetwork.ISOLATED).to_dict()
    with pytest.raises(ProtocolError, match=r"protocol version 2 of SandboxSpecVersion1 is newer than this side's 1"):
        SandboxSpecVersion1.from_dict(wire)
    assert Progress.VERSION == 1  # every other message keeps the protocol's version


@pytest.mark.parametrize(("spec", "nodes", "said"), [
    (SandboxSpec(uid=7, network=JobNetwork.HOST), 2, "network: host (the job asked for the node's network)"),
    (SandboxSpec(uid=7, network=JobNetwork.HOST), 1, "network: host (the job asked for the node's network)"),
    (SandboxSpec(unconfined_reason="off", network=JobNetwork.HOST), 1, "network: host (unconfined)"),
], ids=["spans hosts", "asked", "unconfined"])
def test_the_sandbox_line_says_why_a_job_has_the_host_network(spec, nodes, said):
    assert spec.describe(nodes=nodes).endswith(said)


# -- the job network of a job spanning hosts: addresses and their checks ---------------------------------
def test_a_jobs_parts_get_consecutive_addresses_of_its_own_block_of_the_shared_range():
    assert job_part_addresses(job_id=1, nodes=3) == ("100.64.0.64", "100.64.0.65", "100.64.0.66")
    assert job_part_addresses(job_id=65_535, nodes=2) == ("100.127.255.192", "100.127.255.193")  # the last block
    assert job_part_addresses(job_id=65_536 + 1, nodes=2) == job_part_addresses(job_id=1, nodes=2)  # wraps


def test_live_jobs_with_ids_in_one_window_of_the_block_count_never_share_an_address():
    """The derivation's guarantee (the rest is refused on the node that would route both: netns.claim_address)."""
    seen = {}
    for job_id in range(1_000_000, 1_000_000 + JOB_NETWORK_BLOCKS, 61):
        for address in job_part_addresses(job_id=job_id, nodes=JOB_NETWORK_HOSTS):
            assert seen.setdefault(address, job_id) == job_id, address
            assert ipaddress.IPv4Address(address) in JOB_NETWORK_RANGE


@pytest.mark.parametrize(("job_id", "nodes"), [(0, 2), (5, 1), (5, JOB_NETWORK_HOSTS + 1)],
                         ids=["job-0", "one-host", "more-hosts-than-a-block"])
def test_no_addresses_for_what_cannot_have_a_network_across_hosts(job_id, nodes):
    with pytest.raises(ValueError):
        job_part_addresses(job_id=job_id, nodes=nodes)


def test_a_spec_carries_its_job_addresses_and_names_them_in_its_line():
    spec = SandboxSpec(uid=7, gid=7, network=JobNetwork.ISOLATED, job_addresses=job_part_addresses(job_id=9, nodes=2))
    assert SandboxSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.describe(nodes=2).endswith(f"network: isolated ({NETWORK_SPANS_HOSTS}: 100.64.2.64, 100.64.2.65)")


@pytest.mark.parametrize(("addresses", "network", "problem"), [
    (["10.0.0.5", "100.64.0.1"], "isolated", "outside the job range"),  # a node's address: never routed to a job
    (["127.0.0.1"], "isolated", "outside the job range"),
    (["100.64.0.1", "100.64.0.1"], "isolated", "distinct"),
    (["100.64.0.63", "100.64.0.64"], "isolated", "one job's block"),
    (["100.64.0.1/32"], "isolated", "not an IPv4 address"),
    (["fd00::1"], "isolated", "not an IPv4 address"),
    (["100.64.0.1", "100.64.0.2"], "host", "only with network"),
], ids=["node-address", "loopback", "twice", "two-blocks", "a-prefix", "ipv6", "host-network"])
def test_a_spec_with_job_addresses_a_launcher_must_not_route_is_refused(addresses, network, problem):
    with pytest.raises(ProtocolError, match=problem) as refused:
        SandboxSpec.from_dict({"v": 2, "uid": 7, "network": network, "job_addresses": addresses})
    assert refused.value.field.startswith("job_addresses")


def test_a_spec_with_more_addresses_than_a_block_is_refused_by_its_bound():
    with pytest.raises(ProtocolError) as refused:
        SandboxSpec.from_dict({"v": 2, "uid": 7, "network": "isolated",
                               "job_addresses": [f"100.64.1.{k}" for k in range(JOB_NETWORK_HOSTS + 1)]})
    assert refused.value.field == "job_addresses"


@pytest.mark.parametrize("addr", ["100.64.0.9", "224.0.0.1", "0.0.0.0", "node-a", "::1"])
def test_a_published_node_address_a_launcher_must_not_route_through_is_refused(addr):
    with pytest.raises(ProtocolError) as refused:
        NodeAddress.from_dict({"job_id": "j", "node_rank": 1, "addr": addr})
    assert refused.value.field == "addr"
