"""A copy restored from a checkpoint is one "restored" event on the job's timeline (issue 17 §3: the
way back of a checkpoint, stage by stage), whatever the number of reports that say it: the node's
agent repeats it (level-triggered, protocol.node.RestoreReport), the control plane writes it once per
placement generation. Agents are played by node_report_apply (what their heartbeat API calls); what
the agent puts in the report is tested against a launcher's real events (tests/agent/test_node.py)."""
import pytest
from node_reports import make_node
from rest_framework.test import APIClient

from jobs.models import JobEvent
from jobs.services import job_submit
from jobs.tick import tick_run
from jobs.workflows import node_report_apply
from protocol import ProtocolError
from protocol.node import RestoreReport

pytestmark = pytest.mark.django_db

FRAMEWORK = {"step": 30, "engine": "framework", "seconds": 1.25, "load_s": 0.5, "apply_s": 0.25,
             "device_bytes": 1_000_000_000}
CRIU_GPU = {"step": 30, "engine": "criu", "seconds": 6.0, "device_in": 2.5}


@pytest.fixture(autouse=True)
def policy(short_policy):
    """short_policy (tests/jobs/conftest.py)."""


def running_job(team, user, job_spec):
    job = job_submit(team=team, submitted_by=user, spec=job_spec(world_size=1, min_devices=1))
    tick_run()
    job.refresh_from_db()
    return job


def say(node, job, restore, *, generation=None, step=31):
    entry = {"job_id": job.pk, "state": "running", "step": step, "devices": 1,
             "generation": job.generation if generation is None else generation, "restore": restore}
    return node_report_apply(node=node, report={"jobs": [entry]})


def test_a_restore_is_one_event_with_its_stages_whatever_the_reports(alice, team_a, job_spec):
    node = make_node("n1")
    job = running_job(team_a, alice, job_spec)
    for step in (31, 32, 33):  # said on every report of the copy
        assert say(node, job, FRAMEWORK, step=step)["accepted"] == [job.pk]
    (event,) = JobEvent.objects.filter(job=job, type=JobEvent.Type.RESTORED)
    assert event.reason == ("restored on n1 from step 30 (framework engine) in 1.25 s; then the ranks' state "
                            "store -> host 0.50 s, into the script's objects 0.25 s, 1.00 GB to devices, 4.00 GB/s")
    assert event.extra_data["generation"] == job.generation and event.extra_data["load_s"] == 0.5
    # What `meridian events` and the job page read.
    client = APIClient()
    client.force_authenticate(alice)
    events = client.get(f"/api/jobs/{job.pk}/events/").json()["results"]
    assert [e["reason"] for e in events if e["type"] == "restored"] == [event.reason]


def test_a_criu_restore_of_a_gpu_job_says_the_drivers_move_back(alice, team_a, job_spec):
    node = make_node("n1")
    job = running_job(team_a, alice, job_spec)
    say(node, job, CRIU_GPU)
    (event,) = JobEvent.objects.filter(job=job, type=JobEvent.Type.RESTORED)
    assert event.reason == ("restored on n1 from step 30 (criu engine) in 6.00 s; of which the ranks' CUDA "
                            "state host -> device 2.50 s")


def test_each_generation_gets_its_own_and_an_old_copys_report_none(alice, team_a, job_spec):
    node = make_node("n1")
    job = running_job(team_a, alice, job_spec)
    say(node, job, CRIU_GPU)
    type(job).objects.filter(pk=job.pk).update(generation=job.generation + 1)  # relaunched here (a resize)
    job.refresh_from_db()
    answer = say(node, job, FRAMEWORK, generation=job.generation - 1)  # the old copy, still reporting
    assert answer["accepted"] == [] and JobEvent.objects.filter(job=job, type=JobEvent.Type.RESTORED).count() == 1
    say(node, job, FRAMEWORK)
    assert [e.extra_data["generation"] for e in JobEvent.objects.filter(
        job=job, type=JobEvent.Type.RESTORED).order_by("id")] == [job.generation - 1, job.generation]


def test_a_nodes_restore_figures_are_bounded_like_everything_it_sends():
    with pytest.raises(ProtocolError, match="seconds"):
        RestoreReport.from_dict({**CRIU_GPU, "seconds": -1.0})
    with pytest.raises(ProtocolError, match="device_bytes"):
        RestoreReport.from_dict({**FRAMEWORK, "device_bytes": 2**70})
    with pytest.raises(ProtocolError, match="engine"):
        RestoreReport.from_dict({**FRAMEWORK, "engine": "x" * 65})
