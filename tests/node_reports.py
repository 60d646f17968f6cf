"""What a test that plays a node agent reports (Django tests only): its nodes, its reports (about
checkpoints too), what it is told, and the Celery worker that acts on them.

The control plane records a checkpoint only in the reporting copy's own store folder
(jobs.workflows.job_store_uri: <root>/job-<id>/g<generation>) and with the sha256 of its manifest;
these build such a report the way the real agent does, for tests that do not write a store.
"""
from django.conf import settings

from fleet.agent_services import node_register
from fleet.models import Node
from jobs.models import Job, Move, Replica
from jobs.moves import move_advance
from jobs.workflows import job_store_uri, node_desired_state, node_report_apply

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


def make_node(hostname, devices=4, accelerator_type="CPU"):
    """Registers a node of `devices` devices of `accelerator_type` in region "eu", cluster "c1" (the
    enrollment token short_policy sets)."""
    node, _token = node_register(enrollment=settings.MERIDIAN_AGENT_ENROLLMENT_TOKEN, hostname=hostname,
                                 region="eu", cluster="c1", devices=[{"type": accelerator_type}] * devices)
    return node


def hosts_of(job):
    """Returns the hostnames the job's replicas lie on, sorted."""
    return sorted(set(Replica.objects.filter(job=job).values_list("device__node__hostname", flat=True)))


def report(node, job_id, state, *, generation=None, step=10, devices=4, cut=None, checkpoint_step=None, error=None,
           host_failure=False, restarted=None, now=None):
    """Reports, as `node`'s agent, its copy of `job_id` (of `generation`; None: not said) in `state`;
    returns the answer."""
    entry = {"job_id": job_id, "state": state, "step": step, "devices": devices}
    optional = {"generation": generation, "cut": cut, "error": error, "restarted": restarted}
    entry.update({key: value for key, value in optional.items() if value is not None})
    if host_failure:
        entry["host_failure"] = True
    if checkpoint_step is not None:
        entry["checkpoint"] = {"step": checkpoint_step, "bytes": 100, "engine": "framework",
                               "uri": copy_checkpoint_uri(node, job_id, checkpoint_step, generation=generation),
                               "sha256": FAKE_MANIFEST_SHA256}
    return node_report_apply(node=node, report={"jobs": [entry]}, now=now)


def worker():
    """Plays the Celery worker: runs the move_advance tasks the reports enqueued."""
    for move_id in Move.objects.filter(state=Move.State.ACTIVE).values_list("id", flat=True):
        move_advance(move_id=move_id)


def entry_of(node, job_id):
    """Returns what `node` is told about `job_id` (its desired-state entry), or None."""
    return next((e for e in node_desired_state(node=node)["jobs"] if e["job_id"] == job_id), None)


def step_names(job, move):
    """Returns the steps of `move` completed so far, in order, from the job's events."""
    from jobs.models import JobEvent
    return [e.extra_data.get("step") for e in JobEvent.objects.filter(job=job, type=JobEvent.Type.MOVE_STEP)
            .order_by("created_at", "id") if e.extra_data.get("move") == move.pk]
