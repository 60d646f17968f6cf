"""The control plane <-> agent messages (protocol/node.py) and the state words (protocol/states.py)."""
from dataclasses import dataclass

import pytest

from protocol import PROTOCOL_VERSION, Message, ProtocolError
from protocol.node import (
    MAX_JOBS_PER_NODE,
    CheckpointReport,
    CutReport,
    DesiredJob,
    DesiredState,
    DeviceDescription,
    DeviceReading,
    Heartbeat,
    HeartbeatAnswer,
    JobReport,
    Registration,
    RegistrationAnswer,
    Rejection,
    Telemetry,
)
from protocol.states import FINAL_COPY_STATES, LIVE_COPY_STATES, CopyState, CutAction, DesiredAction, JobState

REPORT = JobReport(job_id=7, state=CopyState.STOPPED, generation=2, step=42, steps_per_s=3.5, devices=2,
                   engine="framework", checkpoint=CheckpointReport(uri="file:///s/job-7/g2/ckpt-42", step=42,
                                                                   bytes=100, engine="framework"),
                   cut=CutReport(action=CutAction.STOP, step=42), restored_step=10)
DESIRED = DesiredState(node_id=3, hostname="n1", state="ready", lost_after_seconds=30.0, jobs=(
    DesiredJob(job_id=7, action=DesiredAction.RUN, generation=2, name="b", tier="basic", state=JobState.RUNNING,
               world_size=8, devices=3, device_indices=(0, 2, 5), entrypoint="train.py", args=("--steps", "9"),
               env={"LR": "0.1"}, store="/s/job-7/g2", restore_from="file:///s/job-7/g1/ckpt-40",
               last_checkpoint_step=40),
    DesiredJob(job_id=8, action=DesiredAction.STOP, generation=1, move="migration", move_step="barrier"),
))


@pytest.mark.parametrize("message", [
    Registration(hostname="n1", devices=(DeviceDescription(type="H100-80GB", memory_gb=80, uuid="GPU-1"),),
                 region="eu", cluster="c1", rack="r1", agent_version="meridian-agent/0.1"),
    RegistrationAnswer(node_id=3, token="t0k3n", hostname="n1", heartbeat_seconds=5.0),
    Heartbeat(telemetry=Telemetry(utilization=0.5, memory_used_gb=12.0,
                                  devices=(DeviceReading(index=0, utilization=0.5, memory_used_gb=12.0),)),
              jobs=(REPORT, JobReport(job_id=8, state=CopyState.FAILED, error="boom", exit_code=-9))),
    DESIRED,
    HeartbeatAnswer(desired=DESIRED, accepted=(7,), rejected=(Rejection(job_id=9, error="stale", fence=True),),
                    deferred=(8,), heartbeat_seconds=5.0),
], ids=["registration", "registration-answer", "heartbeat", "desired-state", "heartbeat-answer"])
def test_every_node_message_round_trips_through_its_wire_dict(message):
    wire = message.to_dict()
    assert wire["v"] == PROTOCOL_VERSION
    assert type(message).from_dict(wire) == message


def test_state_words_go_on_the_wire_as_plain_strings_and_come_back_as_members():
    wire = REPORT.to_dict()
    assert type(wire["state"]) is str and wire["state"] == "stopped" and wire["cut"]["action"] == "stop"
    decoded = JobReport.from_dict(wire)
    assert decoded.state is CopyState.STOPPED and decoded.state.is_final and decoded.cut.action is CutAction.STOP
    assert CopyState.RUNNING == "running" and not CopyState.RUNNING.is_final
    assert FINAL_COPY_STATES | LIVE_COPY_STATES == set(CopyState)


def test_job_states_on_the_wire_are_the_databases_words():
    from jobs.models import Job

    assert {state.value for state in JobState} == set(Job.State.values)


def test_the_desired_state_carries_the_node_local_device_indices_with_the_count():
    entry = DesiredState.from_dict(DESIRED.to_dict()).jobs[0]
    assert entry.device_indices == (0, 2, 5) and entry.devices == len(entry.device_indices)
    assert DESIRED.to_dict()["jobs"][0]["device_indices"] == [0, 2, 5]


def test_an_old_agents_heartbeat_without_a_version_or_generation_is_version_1():
    heartbeat = Heartbeat.from_dict({"jobs": [{"job_id": 4, "state": "running", "step": 3, "devices": 1}],
                                     "telemetry": {"utilization": 0.25}})
    assert heartbeat.jobs[0] == JobReport(job_id=4, state=CopyState.RUNNING, step=3, devices=1)
    assert heartbeat.telemetry.utilization == 0.25 and heartbeat.telemetry.devices == ()
    assert Heartbeat.from_dict({}) == Heartbeat()


@pytest.mark.parametrize("obj, field", [
    ({"jobs": [{"job_id": "abc", "state": "running"}]}, "jobs.0.job_id"),
    ({"jobs": [{"job_id": 0, "state": "running"}]}, "jobs.0.job_id"),
    ({"jobs": [{"job_id": 1}]}, "jobs.0.state"),
    ({"jobs": [{"job_id": 1, "state": "exploded"}]}, "jobs.0.state"),
    ({"jobs": [{"job_id": 1, "state": "running", "step": -1}]}, "jobs.0.step"),
    ({"jobs": [{"job_id": 1, "state": "running", "generation": "2"}]}, "jobs.0.generation"),
    ({"jobs": [{"job_id": 1, "state": "running", "cut": {"action": "nap", "step": 1}}]}, "jobs.0.cut.action"),
    ({"jobs": [{"job_id": 1, "state": "running", "checkpoint": {"step": 1}}]}, "jobs.0.checkpoint.uri"),
    ({"jobs": [{"job_id": 1, "state": "failed", "error": "x" * 5000}]}, "jobs.0.error"),
    ({"jobs": [{"job_id": 1, "state": "running"}] * (MAX_JOBS_PER_NODE + 1)}, "jobs"),
    ({"jobs": {}}, "jobs"),
    ({"telemetry": []}, "telemetry"),
    ({"telemetry": {"utilization": 1.5}}, "telemetry.utilization"),
    ({"telemetry": {"devices": [{"index": -1}]}}, "telemetry.devices.0.index"),
    ({"v": PROTOCOL_VERSION + 1}, "v"),
], ids=["string-id", "zero-id", "no-state", "unknown-state", "negative-step", "string-generation", "unknown-cut",
        "checkpoint-without-uri", "long-error", "too-many-jobs", "object-for-jobs", "list-for-telemetry",
        "utilization-above-1", "negative-device-index", "newer-version"])
def test_a_malformed_heartbeat_is_refused_by_the_fields_path(obj, field):
    with pytest.raises(ProtocolError) as caught:
        Heartbeat.from_dict(obj)
    assert caught.value.field == field


@pytest.mark.parametrize("obj, field", [
    ({"devices": [{"type": "CPU"}]}, "hostname"),
    ({"hostname": "n1", "devices": "CPU"}, "devices"),
    ({"hostname": "n1", "devices": [{"type": 5}]}, "devices.0.type"),
    ({"hostname": "n1", "devices": [{"type": "CPU"}] * 65}, "devices"),
    ({"hostname": "n" * 254, "devices": [{"type": "CPU"}]}, "hostname"),
], ids=["no-hostname", "string-devices", "number-type", "too-many-devices", "long-hostname"])
def test_a_malformed_registration_is_refused_by_the_fields_path(obj, field):
    with pytest.raises(ProtocolError) as caught:
        Registration.from_dict(obj)
    assert caught.value.field == field


@dataclass(frozen=True)
class WithEnum(Message):
    state: CopyState
    maybe: DesiredAction | None = None


def test_an_enum_field_takes_only_its_words():
    assert WithEnum.from_dict({"state": "running", "maybe": "stop"}) == WithEnum(CopyState.RUNNING, DesiredAction.STOP)
    for bad in ("Running", 1, True, None, ["running"]):
        with pytest.raises(ProtocolError) as caught:
            WithEnum.from_dict({"state": bad})
        assert caught.value.field == "state"


def test_the_json_schema_names_every_field_with_its_bounds():
    schema = Heartbeat.json_schema()
    assert schema["title"] == "Heartbeat" and schema["properties"]["v"]["maximum"] == PROTOCOL_VERSION
    jobs = schema["properties"]["jobs"]
    assert jobs["type"] == "array" and jobs["maxItems"] == MAX_JOBS_PER_NODE
    report = jobs["items"]
    assert report["required"] == ["job_id", "state"]
    assert report["properties"]["state"]["enum"] == [state.value for state in CopyState]
    assert report["properties"]["step"] == {"type": "integer", "nullable": True, "minimum": 0, "maximum": 2**63 - 1}
    assert report["properties"]["error"]["maxLength"] == 4096
    assert report["properties"]["cut"]["properties"]["action"]["enum"] == ["stop", "checkpoint", "resize"]
    assert DesiredJob.json_schema()["properties"]["env"]["maxProperties"] == 500


def test_a_cut_report_names_its_kind_from_a_fixed_set_only():
    from protocol import ProtocolError
    report = CutReport(action=CutAction.STOP, step=3, kind="collective-boundary")
    assert CutReport.from_dict(report.to_dict()) == report
    assert CutReport.from_dict({"action": "stop", "step": 3}).kind is None  # an older agent
    with pytest.raises(ProtocolError):
        CutReport.from_dict({"action": "stop", "step": 3, "kind": "x" * 10000})


def test_the_desired_state_carries_the_jobs_resume_policy_as_its_word():
    from protocol.states import ResumeRefused

    entry = DesiredJob(job_id=7, action=DesiredAction.RUN, generation=2, world_size=2, devices=1,
                       entrypoint="train.py", if_resume_refused=ResumeRefused.RESTART)
    wire = DesiredState(node_id=3, jobs=(entry,)).to_dict()
    assert wire["jobs"][0]["if_resume_refused"] == "restart"
    assert DesiredState.from_dict(wire).jobs[0].if_resume_refused is ResumeRefused.RESTART


def test_an_older_control_planes_entry_without_a_resume_policy_fails_a_refused_resume():
    from protocol.states import ResumeRefused

    wire = DESIRED.to_dict()
    for entry in wire["jobs"]:
        entry.pop("if_resume_refused", None)
    assert [job.if_resume_refused for job in DesiredState.from_dict(wire).jobs] == [ResumeRefused.FAIL] * 2


def test_a_resume_policy_that_is_not_a_known_word_is_refused_by_the_fields_path():
    wire = DESIRED.to_dict()
    wire["jobs"][0]["if_resume_refused"] = "retry"
    with pytest.raises(ProtocolError) as caught:
        DesiredState.from_dict(wire)
    assert caught.value.field == "jobs.0.if_resume_refused" and "'restart'" in caught.value.problem


def test_resume_policies_on_the_wire_are_the_databases_words():
    from jobs.models import Job
    from protocol.states import ResumeRefused

    assert {policy.value for policy in ResumeRefused} == set(Job.ResumeRefused.values)


def test_a_report_says_why_its_copy_was_restarted_from_scratch_and_an_old_one_says_nothing():
    report = JobReport(job_id=4, state=CopyState.RUNNING, restarted="the resume was refused: weights differ")
    assert JobReport.from_dict(report.to_dict()).restarted == "the resume was refused: weights differ"
    assert JobReport.from_dict({"job_id": 4, "state": "running"}).restarted is None


def test_a_desired_entry_of_an_older_control_plane_is_isolated_and_a_bad_network_is_refused():
    """An entry without `network` (a control plane that predates it) asks for the safe one."""
    entry = {"job_id": 7, "action": "run", "generation": 2, "world_size": 1, "devices": 1}
    assert DesiredJob.from_dict(entry).network == "isolated"
    assert DesiredJob.from_dict({**entry, "network": "host"}).network == "host"
    with pytest.raises(ProtocolError) as refused:
        DesiredJob.from_dict({**entry, "network": "bridge"})
    assert refused.value.field == "network"
