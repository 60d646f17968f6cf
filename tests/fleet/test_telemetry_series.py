"""telemetry_series: a scope's history from the rollups plus the live edge not rolled up yet."""
from datetime import datetime, timedelta, timezone

import pytest
from django.core.exceptions import ValidationError
from django.db import transaction

from fleet.models import Node, TelemetryResolution
from fleet.selectors import telemetry_series, telemetry_window
from fleet.services import fleet_load, node_heartbeat_record, telemetry_rollup

MINUTE, HOUR = TelemetryResolution.MINUTE, TelemetryResolution.HOUR
T0 = datetime(2026, 11, 29, 10, 0, 0, tzinfo=timezone.utc)


@pytest.fixture
def fleet(db):
    """east/c0: n1, n2 (2 H100 each); east/c1: n3 (2 A100); west/c0: n4 (2 H100)."""
    def node(name, type_name):
        return {"hostname": name, "accelerators": {"type": type_name, "count": 2}}

    fleet_load(description={"regions": [
        {"name": "east", "clusters": [{"name": "c0", "nodes": [node("n1", "H100-80GB"), node("n2", "H100-80GB")]},
                                      {"name": "c1", "nodes": [node("n3", "A100-80GB")]}]},
        {"name": "west", "clusters": [{"name": "c0", "nodes": [node("n4", "H100-80GB")]}]},
    ]})
    return {n.hostname: n for n in Node.objects.all()}


def beat(node, now, utilization, memory=10.0):
    with transaction.atomic():
        node_heartbeat_record(node=node, now=now, telemetry={"devices": [
            {"index": i, "utilization": utilization, "memory_used_gb": memory} for i in range(2)]})


@pytest.fixture
def ninety_minutes(fleet):
    """Every node reports once a minute for 90 minutes from T0: n1 at 0.2, n2 at 0.4, n3 at 0.6,
    n4 at 0.8; rolled up at T0 + 80 min (so minutes 80..89 are only in the node rows)."""
    levels = {"n1": 0.2, "n2": 0.4, "n3": 0.6, "n4": 0.8}
    for minute in range(90):
        for name, level in levels.items():
            beat(fleet[name], T0 + timedelta(minutes=minute, seconds=3), level)
        if minute == 79:
            telemetry_rollup(now=T0 + timedelta(minutes=80, seconds=30))
    return fleet


def test_the_fleet_series_is_the_device_weighted_mean_per_minute_up_to_the_live_edge(ninety_minutes):
    series = telemetry_series(since=T0, until=T0 + timedelta(minutes=90), resolution=MINUTE)

    assert [p["t"] for p in series] == [T0 + timedelta(minutes=k) for k in range(90)]
    assert {p["utilization_mean"] for p in series} == {0.5}
    assert {(p["utilization_max"], p["device_samples"], p["memory_used_gb_mean"]) for p in series} == {(0.8, 8, 10.0)}


def test_a_series_narrows_to_a_region_a_cluster_a_type_or_a_node(ninety_minutes):
    fleet = ninety_minutes
    window = {"since": T0 + timedelta(minutes=70), "until": T0 + timedelta(minutes=90), "resolution": MINUTE}

    def means(**scope):
        return {p["utilization_mean"] for p in telemetry_series(**window, **scope)}

    assert means(region="east") == {0.4}                      # n1, n2, n3 alike
    assert means(cluster_id=fleet["n1"].cluster_id) == {0.3}
    assert means(accelerator_type="A100-80GB") == {0.6}
    assert means(region="east", accelerator_type="H100-80GB") == {0.3}
    assert means(node_id=fleet["n4"].pk) == {0.8}
    assert means(region="nowhere") == set()


def test_an_hourly_series_folds_the_unrolled_hour_in_from_the_minutes(ninety_minutes):
    series = telemetry_series(since=T0, until=T0 + timedelta(hours=2), resolution=HOUR)

    assert [(p["t"], p["device_samples"]) for p in series] == [(T0, 60 * 8), (T0 + timedelta(hours=1), 30 * 8)]
    assert {p["utilization_mean"] for p in series} == {0.5}


def test_a_node_series_reads_its_hours_and_then_its_minutes(ninety_minutes):
    node = ninety_minutes["n2"]
    telemetry_rollup(now=T0 + timedelta(hours=3))

    hourly = telemetry_series(since=T0, until=T0 + timedelta(hours=2), resolution=HOUR, node_id=node.pk)

    assert [(p["t"], p["device_samples"], p["utilization_mean"]) for p in hourly] == [
        (T0, 120, 0.4), (T0 + timedelta(hours=1), 60, 0.4)]


def test_minutes_without_readings_are_absent_not_zero(fleet):
    beat(fleet["n1"], T0, 0.5)
    beat(fleet["n1"], T0 + timedelta(minutes=5), 0.5)

    series = telemetry_series(since=T0, until=T0 + timedelta(minutes=10), resolution=MINUTE)

    assert [p["t"] for p in series] == [T0, T0 + timedelta(minutes=5)]


@pytest.mark.parametrize("kwargs, field", [
    ({"since": T0, "hours": 2}, "hours"),
    ({"since": T0, "until": T0}, "since"),
    ({"hours": 24 * 30, "resolution": "minute"}, "resolution"),
    ({"since": T0 - timedelta(days=3), "until": T0 - timedelta(days=3) + timedelta(hours=1), "resolution": "minute"},
     "resolution"),
], ids=["since-and-hours", "empty-window", "too-many-points", "minutes-past-retention"])
def test_a_window_that_cannot_be_answered_says_what_to_change(kwargs, field):
    with pytest.raises(ValidationError) as error:
        telemetry_window(now=T0, **kwargs)
    assert field in error.value.message_dict


def test_the_default_window_is_six_hours_by_minute_and_long_windows_are_hourly():
    assert telemetry_window(now=T0) == (T0 - timedelta(hours=6), T0, MINUTE)
    assert telemetry_window(now=T0, hours=24 * 7)[2] == HOUR


def test_a_nodes_day_defaults_to_hours_because_its_minutes_are_kept_for_six():
    assert telemetry_window(now=T0, hours=24)[2] == MINUTE  # fleet and cluster minutes are kept for 2 days
    assert telemetry_window(now=T0, hours=24, node_level=True)[2] == HOUR
    with pytest.raises(ValidationError, match="on a node"):
        telemetry_window(now=T0, hours=24, resolution="minute", node_level=True)
