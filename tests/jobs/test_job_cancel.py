"""job_cancel and POST /api/jobs/<id>/cancel/."""
import pytest
from django.core.exceptions import PermissionDenied

from jobs.models import Job
from jobs.services import IllegalTransition, job_cancel


def test_a_teammate_cancels_through_the_api(api_client_for, submit, alice, bob, team_a):
    job = submit(team_a, alice)

    response = api_client_for(bob).post(f"/api/jobs/{job.pk}/cancel/")

    assert response.status_code == 200
    assert response.json()["state"] == "cancelled"
    assert Job.objects.get(pk=job.pk).finished_at is not None


def test_cancelling_a_finished_job_is_a_409_that_says_why(api_client_for, submit, alice, team_a):
    job = submit(team_a, alice)
    Job.objects.filter(pk=job.pk).update(state=Job.State.SUCCEEDED)

    response = api_client_for(alice).post(f"/api/jobs/{job.pk}/cancel/")

    assert response.status_code == 409
    assert "cannot go from succeeded to cancelled" in response.json()["detail"]


def test_the_service_refuses_someone_off_the_team(submit, alice, charlie, team_a):
    job = submit(team_a, alice)

    with pytest.raises(PermissionDenied):
        job_cancel(job=job, by=charlie)
    assert Job.objects.get(pk=job.pk).state == Job.State.PENDING


def test_cancel_wins_even_when_the_control_loop_moved_the_job_meanwhile(submit, alice, team_a):
    job = submit(team_a, alice)
    Job.objects.filter(pk=job.pk).update(state=Job.State.SCHEDULED)  # our copy still says pending

    job_cancel(job=job, by=alice)

    assert Job.objects.get(pk=job.pk).state == Job.State.CANCELLED


def test_cancelling_twice_is_an_illegal_transition(submit, alice, team_a):
    job = submit(team_a, alice)
    job_cancel(job=job, by=alice)

    with pytest.raises(IllegalTransition, match="it has finished"):
        job_cancel(job=job, by=alice)
