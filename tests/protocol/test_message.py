"""The wire-message base: what it encodes, and that a malformed field is refused by name."""
from dataclasses import dataclass
from typing import Literal

import pytest

from protocol import PROTOCOL_VERSION, Message, ProtocolError
from protocol.message import bounded


@dataclass(frozen=True)
class Inner(Message):
    index: int = bounded(minimum=0, maximum=7)


@dataclass(frozen=True)
class Outer(Message):
    job_id: int = bounded(minimum=1)
    action: Literal["stop", "resize"]
    devices: tuple[Inner, ...] = bounded(default=(), max_length=4)
    note: str | None = None
    load: float = 0.0
    tags: dict[str, int] | None = None
    flag: bool = False


def test_a_message_round_trips_through_its_wire_dict_with_the_version():
    message = Outer(job_id=3, action="stop", devices=(Inner(index=1), Inner(index=4)), note="x",
                    load=1.5, tags={"a": 1}, flag=True)
    wire = message.to_dict()
    assert wire["v"] == PROTOCOL_VERSION
    assert wire["devices"] == [{"index": 1}, {"index": 4}]
    assert Outer.from_dict(wire) == message


def test_missing_optional_fields_take_their_defaults_and_null_means_absent():
    assert Outer.from_dict({"job_id": 1, "action": "resize", "note": None}) == Outer(job_id=1, action="resize")


@pytest.mark.parametrize("obj, field", [
    ({"action": "stop"}, "job_id"),
    ({"job_id": "abc", "action": "stop"}, "job_id"),
    ({"job_id": True, "action": "stop"}, "job_id"),
    ({"job_id": 0, "action": "stop"}, "job_id"),
    ({"job_id": 1, "action": "explode"}, "action"),
    ({"job_id": 1, "action": "stop", "devices": {}}, "devices"),
    ({"job_id": 1, "action": "stop", "devices": [{"index": 9}]}, "devices.0.index"),
    ({"job_id": 1, "action": "stop", "devices": [{"index": 1}] * 5}, "devices"),
    ({"job_id": 1, "action": "stop", "load": float("nan")}, "load"),
    ({"job_id": 1, "action": "stop", "tags": {"a": "b"}}, "tags.a"),
    ({"job_id": 1, "action": "stop", "flag": 1}, "flag"),
    ({"job_id": 1, "action": "stop", "v": PROTOCOL_VERSION + 1}, "v"),
], ids=["missing", "string-for-int", "bool-for-int", "below-minimum", "bad-literal", "object-for-list",
        "nested-out-of-bounds", "too-many", "nan", "bad-dict-value", "int-for-bool", "newer-version"])
def test_a_malformed_field_is_refused_by_its_path(obj, field):
    with pytest.raises(ProtocolError) as caught:
        Outer.from_dict(obj)
    assert caught.value.field == field


def test_a_non_object_is_refused():
    with pytest.raises(ProtocolError, match="JSON object"):
        Outer.from_dict([])
