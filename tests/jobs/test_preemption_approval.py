"""Preemption requests: created idempotently by the control loop; only capacity managers
(or admins) of the job's team, or global admins, approve or deny; they expire."""
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.models import Job, JobEvent, PreemptionRequest
from jobs.services import (
    IllegalTransition,
    preemption_approve,
    preemption_deny,
    preemption_expire_due,
    preemption_request_create,
)


@pytest.fixture
def running_job(submit, alice, team_a):
    job = submit(team_a, alice, tier="standard")
    Job.objects.filter(pk=job.pk).update(state=Job.State.RUNNING)
    job.refresh_from_db()
    return job


@pytest.fixture
def request_for(running_job):
    return preemption_request_create(job=running_job, reason="premium job 9 needs 4 CPU", lost_work_seconds=120.0)


def test_creating_twice_returns_the_pending_request(running_job, request_for):
    again = preemption_request_create(job=running_job, reason="again", lost_work_seconds=1.0)

    assert again.pk == request_for.pk
    assert PreemptionRequest.objects.count() == 1
    assert JobEvent.objects.filter(type=JobEvent.Type.PREEMPTION_REQUESTED).count() == 1


def test_carol_approves_through_the_api(api_client_for, carol, request_for):
    response = api_client_for(carol).post(f"/api/preemptions/{request_for.pk}/approve/", {"note": "go"}, format="json")

    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["state"], body["decided_by"], body["note"]) == ("approved", "carol", "go")
    assert JobEvent.objects.filter(type=JobEvent.Type.PREEMPTION_APPROVED, actor=carol).exists()


def test_carol_denies_and_the_job_keeps_running(api_client_for, carol, request_for, running_job):
    response = api_client_for(carol).post(
        f"/api/preemptions/{request_for.pk}/deny/", {"note": "deadline"}, format="json"
    )

    assert response.json()["state"] == "denied"
    assert Job.objects.get(pk=running_job.pk).state == Job.State.RUNNING


@pytest.mark.parametrize("action", ["approve", "deny"])
@pytest.mark.parametrize("who", ["alice", "bob"])
def test_members_who_are_not_capacity_managers_get_403(api_client_for, cast, request_for, who, action):
    response = api_client_for(getattr(cast, who)).post(f"/api/preemptions/{request_for.pk}/{action}/")

    assert response.status_code == 403
    assert "only capacity managers" in response.json()["detail"]
    assert PreemptionRequest.objects.get(pk=request_for.pk).state == "pending"


def test_charlie_on_another_team_gets_404(api_client_for, charlie, request_for):
    assert api_client_for(charlie).post(f"/api/preemptions/{request_for.pk}/approve/").status_code == 404
    assert api_client_for(charlie).get("/api/preemptions/").json()["results"] == []


def test_a_capacity_manager_of_another_team_may_not_approve(django_user_model, request_for, cast):
    from jobs.models import Membership
    from jobs.services import membership_set, team_create

    erin = django_user_model.objects.create_user("erin", password="x")
    membership_set(team=team_create(name="Team C", slug="team-c"), user=erin, role=Membership.Role.CAPACITY_MANAGER)
    membership_set(team=cast.team_a, user=erin, role=Membership.Role.MEMBER)

    with pytest.raises(Exception, match="only capacity managers"):
        preemption_approve(request=request_for, by=erin)


def test_a_global_admin_may_approve(admin_user, request_for):
    assert preemption_approve(request=request_for, by=admin_user).state == "approved"


def test_a_decided_request_cannot_be_decided_again(api_client_for, carol, request_for):
    preemption_deny(request=request_for, by=carol)

    response = api_client_for(carol).post(f"/api/preemptions/{request_for.pk}/approve/")

    assert response.status_code == 409
    assert "was already denied" in response.json()["detail"]


def test_requests_expire_and_cannot_be_approved_after(carol, request_for):
    later = request_for.expires_at + timedelta(seconds=1)

    with pytest.raises(IllegalTransition, match="expired at"):
        preemption_approve(request=request_for, by=carol, now=later)
    assert preemption_expire_due(now=later) == 1
    assert preemption_expire_due(now=later) == 0
    assert PreemptionRequest.objects.get(pk=request_for.pk).state == "expired"
    assert JobEvent.objects.filter(type=JobEvent.Type.PREEMPTION_EXPIRED).count() == 1


def test_not_yet_due_requests_are_left_alone(request_for):
    assert preemption_expire_due(now=timezone.now()) == 0


def test_the_list_shows_blast_radius_and_who_may_decide(
    api_client_for, carol, alice, request_for, django_assert_max_num_queries
):
    with django_assert_max_num_queries(3):
        row = api_client_for(carol).get("/api/preemptions/", {"state": "pending"}).json()["results"][0]

    assert row["lost_work_seconds"] == 120.0
    assert (row["job"]["tier"], row["job"]["team"]["slug"], row["can_decide"]) == ("standard", "team-a", True)
    assert api_client_for(alice).get("/api/preemptions/").json()["results"][0]["can_decide"] is False
