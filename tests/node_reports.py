"""What a test that plays a node agent reports about checkpoints (Django tests only).

The control plane records a checkpoint only in the reporting copy's own store folder
(jobs.workflows.job_store_uri: <root>/job-<id>/g<generation>) and with the sha256 of its manifest;
these build such a report the way the real agent does, for tests that do not write a store.
"""
from django.conf import settings

from fleet.agent_services import node_register
from fleet.models import Node
from jobs.models import Job, Move, Replica
from jobs.workflows import job_store_uri

# The digest a test reports for a checkpoint it never wrote (no restore reads it in these tests).
FAKE_MANIFEST_SHA256 = "ab" * 32


def copy_generation(node: Node, job_id: int) -> int:
    """Returns the generation the control plane takes a report of `node` on `job_id` to be about
    when it names none (jobs.workflows.node_report_record): the old copy of an active move off
    `node`, else the job's current generation."""
    job = Job.objects.get(pk=job_id)
    here = Replica.objects.filter(job_id=job_id, device__node_id=node.pk).exists()
    move = Move.objects.filter(job_id=job_id, state=Move.State.ACTIVE, from_node_id=node.pk).first()
    return move.from_generation if move is not None and not here else job.generation


def copy_checkpoint_uri(node: Node, job_id: int, step: int, *, generation: int | None = None) -> str:
    """Returns a checkpoint URI in the store folder of the copy of `job_id` on `node`."""
    generation = copy_generation(node, job_id) if generation is None else generation
    return f"file://{job_store_uri(job_id, generation=generation)}/ckpt-{step:012d}-1"


def make_node(hostname, devices=4):
    """Registers a node of `devices` CPU devices in region "eu", cluster "c1" (the enrollment token
    short_policy sets)."""
    node, _token = node_register(enrollment=settings.MERIDIAN_AGENT_ENROLLMENT_TOKEN, hostname=hostname,
                                 region="eu", cluster="c1", devices=[{"type": "CPU"}] * devices)
    return node


def hosts_of(job):
    """Returns the hostnames the job's replicas lie on, sorted."""
    return sorted(set(Replica.objects.filter(job=job).values_list("device__node__hostname", flat=True)))
