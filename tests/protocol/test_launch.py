"""Launcher <-> agent messages: the event log, progress.json, the control requests and their answers."""
import json

import pytest

from protocol import ProtocolError
from protocol.cut import DeviceMap
from protocol.launch import (
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
    Started,
    Stopped,
    StopRequest,
    control_answer_from_dict,
    control_request_from_dict,
    event_from_dict,
    event_line,
    parse_events,
)

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
