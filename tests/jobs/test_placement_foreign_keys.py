"""Replica.device and Job.region without a foreign-key constraint in the database (migrations
jobs/0012, jobs/0014): the placement tick no longer pays ~140k deferred checks at commit, and what
the constraints stood for still holds: deleting an accelerator (or its node, or its region) through
Django unplaces the replicas on it and clears the region of its jobs."""
import pytest
from django.db import connection

from fleet.models import Accelerator, Node, Region
from fleet.services import fleet_generate
from jobs.models import Job, Replica
from jobs.services import job_submit

pytestmark = pytest.mark.django_db


@pytest.fixture
def placed(team_a, alice, job_spec):
    """A W = 4 job on two nodes' four devices, rank r on the r-th device."""
    fleet_generate(regions=1, clusters=1, nodes=2, devices=2, accelerator_type="CPU", prefix="rd")
    devices = list(Accelerator.objects.order_by("node__hostname", "index"))
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(world_size=4, min_devices=1))
    for replica in Replica.objects.filter(job=job):
        replica.device = devices[replica.rank]
        replica.save(update_fields=["device"])
    Job.objects.filter(pk=job.pk).update(region=devices[0].node.cluster.region, device_count=4)
    return job, devices


def _devices_by_rank(job):
    return dict(Replica.objects.filter(job=job).values_list("rank", "device_id"))


def test_deleting_an_accelerator_unplaces_the_replica_on_it_and_keeps_the_others(placed):
    job, devices = placed

    devices[1].delete()

    assert _devices_by_rank(job) == {0: devices[0].pk, 1: None, 2: devices[2].pk, 3: devices[3].pk}


def test_deleting_a_node_unplaces_the_replicas_on_its_accelerators(placed):
    job, devices = placed

    Node.objects.filter(pk=devices[2].node_id).delete()

    assert _devices_by_rank(job) == {0: devices[0].pk, 1: devices[1].pk, 2: None, 3: None}


def test_the_database_has_no_constraint_on_a_replicas_device_but_keeps_its_index():
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, Replica._meta.db_table)
    on_device = [c for c in constraints.values() if c["columns"] == ["device_id"]]
    assert not any(c["foreign_key"] for c in on_device)
    assert any(c["index"] for c in on_device)  # the desired-state query looks replicas up by device
    # the job's foreign key is still the database's to enforce
    assert any(c["foreign_key"] for c in constraints.values() if c["columns"] == ["job_id"])


def test_deleting_a_region_clears_its_jobs_region_and_unplaces_their_replicas(placed):
    job, devices = placed

    Region.objects.filter(pk=devices[0].node.cluster.region_id).delete()

    assert Job.objects.get(pk=job.pk).region_id is None
    assert _devices_by_rank(job) == {0: None, 1: None, 2: None, 3: None}


def test_the_database_has_no_constraint_on_a_jobs_region_but_keeps_its_index():
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, Job._meta.db_table)
    on_region = [c for c in constraints.values() if c["columns"] == ["region_id"]]
    assert not any(c["foreign_key"] for c in on_region)
    assert any(c["index"] for c in on_region)
    assert any(c["foreign_key"] for c in constraints.values() if c["columns"] == ["team_id"])
