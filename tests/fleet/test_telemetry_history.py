"""Telemetry history: a heartbeat upserts its node's current minute; the beat task rolls minutes
into cluster minutes and hours and deletes what is past retention. The clock is injected."""
from datetime import datetime, timedelta, timezone

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from fleet.models import (
    TELEMETRY_RETENTION,
    Accelerator,
    ClusterTelemetryBucket,
    Node,
    NodeTelemetryBucket,
    TelemetryResolution,
)
from fleet.services import fleet_load, node_heartbeat_record, telemetry_rollup

MINUTE, HOUR = TelemetryResolution.MINUTE, TelemetryResolution.HOUR
T0 = datetime(2026, 11, 29, 10, 0, 0, tzinfo=timezone.utc)


@pytest.fixture
def fleet(db):
    """Two clusters in one region; n1 carries 2 H100s, n2 2 H100s, n3 (other cluster) 1 H100 + 1 A100."""
    fleet_load(description={"regions": [{"name": "east", "clusters": [
        {"name": "c0", "nodes": [{"hostname": "n1", "accelerators": {"type": "H100-80GB", "count": 2}},
                                 {"hostname": "n2", "accelerators": {"type": "H100-80GB", "count": 2}}]},
        {"name": "c1", "nodes": [{"hostname": "n3", "accelerators": [{"type": "H100-80GB"}, {"type": "A100-80GB"}]}]},
    ]}]})
    return {n.hostname: n for n in Node.objects.all()}


def beat(node, now, *readings, node_utilization=None):
    """One heartbeat of `node` at `now` with (utilization, memory) per device index."""
    devices = [{"index": i, "utilization": u, "memory_used_gb": m} for i, (u, m) in enumerate(readings)]
    telemetry = {"devices": devices}
    if node_utilization is not None:
        telemetry["utilization"] = node_utilization
    with transaction.atomic():
        node_heartbeat_record(node=node, telemetry=telemetry, now=now)


def test_a_heartbeat_writes_the_latest_readings_and_opens_the_nodes_minute(fleet):
    beat(fleet["n1"], T0 + timedelta(seconds=7), (0.5, 10.0), (0.9, 30.0), node_utilization=0.7)

    assert list(Accelerator.objects.filter(node=fleet["n1"]).values_list("utilization", "memory_used_gb")) == [
        (0.5, 10.0), (0.9, 30.0)]
    node = Node.objects.get(pk=fleet["n1"].pk)
    assert (node.utilization, node.last_heartbeat) == (0.7, T0 + timedelta(seconds=7))
    bucket = NodeTelemetryBucket.objects.get()
    assert (bucket.resolution, bucket.bucket_start, bucket.accelerator_type) == (MINUTE, T0, "H100-80GB")
    assert (bucket.heartbeats, bucket.device_samples) == (1, 2)
    assert bucket.utilization_sum == pytest.approx(1.4) and bucket.utilization_max == 0.9
    assert (bucket.memory_used_gb_sum, bucket.memory_used_gb_max) == (40.0, 30.0)


def test_heartbeats_in_the_same_minute_add_to_one_row_and_the_next_minute_opens_another(fleet):
    for second in (0, 5, 55):
        beat(fleet["n1"], T0 + timedelta(seconds=second), (0.2, 1.0), (0.4, 2.0))
    beat(fleet["n1"], T0 + timedelta(seconds=60), (1.0, 5.0), (1.0, 5.0))

    rows = list(NodeTelemetryBucket.objects.order_by("bucket_start"))
    assert [(r.bucket_start, r.heartbeats, r.device_samples) for r in rows] == [
        (T0, 3, 6), (T0 + timedelta(minutes=1), 1, 2)
    ]
    assert rows[0].utilization_sum == pytest.approx(1.8) and rows[0].utilization_max == 0.4
    assert rows[0].memory_used_gb_sum == pytest.approx(9.0)


def test_a_node_with_two_device_types_gets_a_row_per_type(fleet):
    beat(fleet["n3"], T0, (0.3, 3.0), (0.8, 8.0))

    rows = {r.accelerator_type: r for r in NodeTelemetryBucket.objects.all()}
    assert set(rows) == {"H100-80GB", "A100-80GB"}
    assert rows["A100-80GB"].utilization_sum == pytest.approx(0.8)


def test_unknown_indices_and_garbled_readings_are_ignored(fleet):
    beat(fleet["n1"], T0, (0.5, 1.0))
    with transaction.atomic():
        node_heartbeat_record(node=fleet["n1"], now=T0 + timedelta(seconds=5), telemetry={"devices": [
            {"index": 7, "utilization": 0.9}, {"index": "0", "utilization": 0.9}, {"index": 1, "utilization": "busy"},
            "nonsense", {"utilization": 1.0}]})

    bucket = NodeTelemetryBucket.objects.get()
    assert (bucket.heartbeats, bucket.device_samples) == (1, 1)  # the second heartbeat had no usable reading
    assert Accelerator.objects.get(node=fleet["n1"], index=1).utilization is None


def test_a_heartbeat_costs_three_statements_whatever_the_device_count(fleet):
    node = fleet["n1"]
    with CaptureQueriesContext(connection) as two_devices:
        beat(node, T0, (0.5, 1.0), (0.5, 1.0))
    Accelerator.objects.bulk_create([Accelerator(node=node, index=i, type="H100-80GB") for i in range(2, 8)])
    with CaptureQueriesContext(connection) as eight_devices:
        beat(node, T0 + timedelta(seconds=5), *[(0.5, 1.0)] * 8)

    statements = [q["sql"].split()[0].upper() for q in eight_devices.captured_queries
                  if not q["sql"].upper().startswith(("SAVEPOINT", "RELEASE", "BEGIN", "COMMIT"))]
    assert len(two_devices.captured_queries) == len(eight_devices.captured_queries)
    assert statements == ["UPDATE", "WITH", "INSERT"]


def test_the_rollup_sums_nodes_into_cluster_minutes_and_minutes_into_hours(fleet):
    for minute in range(3):
        at = T0 + timedelta(minutes=minute, seconds=1)
        beat(fleet["n1"], at, (0.2, 10.0), (0.4, 10.0))
        beat(fleet["n2"], at, (1.0, 50.0), (0.6, 20.0))
        beat(fleet["n3"], at, (0.5, 5.0), (0.5, 5.0))

    telemetry_rollup(now=T0 + timedelta(hours=1, minutes=1))

    c0 = fleet["n1"].cluster_id
    minutes = ClusterTelemetryBucket.objects.filter(cluster_id=c0, resolution=MINUTE).order_by("bucket_start")
    assert [(m.bucket_start, m.heartbeats, m.device_samples) for m in minutes] == [
        (T0 + timedelta(minutes=k), 2, 4) for k in range(3)]
    assert minutes[0].utilization_sum == pytest.approx(2.2) and minutes[0].utilization_max == 1.0
    hour = ClusterTelemetryBucket.objects.get(cluster_id=c0, resolution=HOUR, accelerator_type="H100-80GB")
    assert (hour.bucket_start, hour.heartbeats, hour.device_samples) == (T0, 6, 12)
    assert hour.utilization_sum == pytest.approx(6.6) and hour.memory_used_gb_max == 50.0
    node_hour = NodeTelemetryBucket.objects.get(node=fleet["n2"], resolution=HOUR)
    assert (node_hour.heartbeats, node_hour.utilization_sum) == (3, pytest.approx(4.8))


def test_the_rollup_leaves_the_current_minute_and_hour_alone_and_is_idempotent(fleet):
    beat(fleet["n1"], T0 + timedelta(seconds=30), (0.5, 1.0), (0.5, 1.0))

    telemetry_rollup(now=T0 + timedelta(seconds=50))  # the minute is not over
    assert not ClusterTelemetryBucket.objects.exists()

    now = T0 + timedelta(minutes=1, seconds=30)
    telemetry_rollup(now=now)
    telemetry_rollup(now=now)  # run twice: replaced, not added
    minute = ClusterTelemetryBucket.objects.get()
    assert (minute.resolution, minute.heartbeats, minute.device_samples) == (MINUTE, 1, 2)
    assert not NodeTelemetryBucket.objects.filter(resolution=HOUR).exists()  # the hour is not over


def test_a_heartbeat_stamped_at_the_end_of_a_minute_is_counted_if_it_commits_within_the_grace(fleet):
    beat(fleet["n1"], T0 + timedelta(seconds=59), (0.5, 1.0), (0.5, 1.0))
    telemetry_rollup(now=T0 + timedelta(seconds=70))  # the minute ended, but only 10 s ago: not rolled yet
    beat(fleet["n2"], T0 + timedelta(seconds=59, microseconds=999), (1.0, 1.0), (1.0, 1.0))  # commits late

    telemetry_rollup(now=T0 + timedelta(minutes=1, seconds=30))
    telemetry_rollup(now=T0 + timedelta(minutes=2, seconds=30))

    assert ClusterTelemetryBucket.objects.get(bucket_start=T0).heartbeats == 2


def test_retention_deletes_old_buckets_in_batches_and_keeps_their_rollups(fleet):
    for minute in range(12):
        beat(fleet["n1"], T0 + timedelta(minutes=minute), (0.5, 1.0), (0.5, 1.0))
    telemetry_rollup(now=T0 + timedelta(hours=1, minutes=5))
    assert NodeTelemetryBucket.objects.filter(resolution=MINUTE).count() == 12

    later = T0 + TELEMETRY_RETENTION[("node", MINUTE)] + timedelta(minutes=6)
    result = telemetry_rollup(now=later, batch_size=5)

    assert result.deleted[f"NodeTelemetryBucket/{MINUTE}"] == 6  # minutes 0..5 began over a day ago
    assert NodeTelemetryBucket.objects.filter(resolution=MINUTE).count() == 6
    assert NodeTelemetryBucket.objects.get(resolution=HOUR).heartbeats == 12
    assert ClusterTelemetryBucket.objects.get(resolution=HOUR).heartbeats == 12

    much_later = T0 + TELEMETRY_RETENTION[("cluster", HOUR)] + timedelta(hours=2)
    telemetry_rollup(now=much_later)
    assert not NodeTelemetryBucket.objects.exists() and not ClusterTelemetryBucket.objects.exists()


def test_the_rollup_catches_up_after_an_outage(fleet):
    for hour in range(3):
        beat(fleet["n1"], T0 + timedelta(hours=hour, minutes=10), (0.5, 1.0), (0.5, 1.0))

    telemetry_rollup(now=T0 + timedelta(hours=3, minutes=1))

    assert ClusterTelemetryBucket.objects.filter(resolution=HOUR).count() == 3
    assert NodeTelemetryBucket.objects.filter(resolution=HOUR).count() == 3


def test_the_callers_node_is_brought_up_to_date_so_it_need_not_refetch(fleet):
    node = fleet["n1"]
    Node.objects.filter(pk=node.pk).update(state=Node.State.LOST)
    node.state = Node.State.LOST

    beat(node, T0, (0.5, 1.0), node_utilization=0.5)

    assert (node.state, node.last_heartbeat, node.utilization) == (Node.State.READY, T0, 0.5)
    assert Node.objects.get(pk=node.pk).state == Node.State.READY
