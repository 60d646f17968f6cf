"""Finding Medium 5 (issue 15): job names do not cross team lines through the scheduler's reasons.

The scheduler names jobs "#<id> <name>" in its reasons (jobs.snapshot); a waiting job of team B
may wait "for approval to preempt job #135 <team A's job name>". What a member is shown names only
jobs of their own teams; capacity managers (who weigh one team's job against another's) and global
admins see every name."""
import pytest

from jobs.models import Job, JobEvent
from jobs.services import job_event_add, preemption_request_create

SECRET = "project-nightingale-llm"


@pytest.fixture
def secret_job(team_a, alice, submit):
    return submit(team_a, alice, name=SECRET)


@pytest.fixture
def waiting_job_b(team_b, charlie, submit, secret_job):
    job = submit(team_b, charlie, name="charlies-job")
    reason = f"waiting for approval to preempt job #{secret_job.pk} {SECRET} (Premium)"
    Job.objects.filter(pk=job.pk).update(wait_reason=reason)
    job_event_add(job=job, type=JobEvent.Type.MESSAGE, reason=f"would preempt job #{secret_job.pk} {SECRET}")
    return job


def test_a_member_of_another_team_does_not_see_the_name_in_the_api(client_for, charlie, waiting_job_b, secret_job):
    client = client_for(charlie)

    listed = client.get("/api/jobs/").json()["results"][0]
    detail = client.get(f"/api/jobs/{waiting_job_b.pk}/").json()
    events = client.get(f"/api/jobs/{waiting_job_b.pk}/events/").json()["results"]

    for text in (listed["wait_reason"], detail["wait_reason"], *(e["reason"] for e in events)):
        assert SECRET not in text
    assert f"#{secret_job.pk} (another team's job)" in detail["wait_reason"]
    assert detail["wait_reason"].startswith("waiting for approval to preempt job")


def test_a_member_of_another_team_does_not_see_the_name_on_the_pages(client, charlie, waiting_job_b):
    client.force_login(charlie)

    for url in ("/jobs/", f"/jobs/{waiting_job_b.pk}/", f"/jobs/{waiting_job_b.pk}/?format=json"):
        body = client.get(url).content.decode()
        assert SECRET not in body, url
        assert "another team" in body, url


def test_the_own_teams_names_and_a_capacity_manager_see_names(client_for, charlie, carol, team_b, submit,
                                                               waiting_job_b, secret_job):
    own = submit(team_b, charlie, name="own-team-job")
    Job.objects.filter(pk=waiting_job_b.pk).update(
        wait_reason=f"behind job #{own.pk} own-team-job and job #{secret_job.pk} {SECRET}")

    seen_by_charlie = client_for(charlie).get(f"/api/jobs/{waiting_job_b.pk}/").json()["wait_reason"]
    seen_by_carol = client_for(carol).get(f"/api/jobs/{waiting_job_b.pk}/").json()["wait_reason"]

    assert f"#{own.pk} own-team-job" in seen_by_charlie and SECRET not in seen_by_charlie
    assert SECRET in seen_by_carol  # carol manages capacity: she weighs A's job against B's


def test_a_preemption_request_naming_another_teams_job_is_redacted(client_for, charlie, team_b, submit, secret_job):
    victim = submit(team_b, charlie, name="victim")
    preemption_request_create(job=victim, reason=f"to make room for job #{secret_job.pk} {SECRET}",
                              lost_work_seconds=10.0)

    body = client_for(charlie).get("/api/preemptions/").json()["results"][0]

    assert SECRET not in body["reason"] and "another team's job" in body["reason"]


def test_the_redaction_matches_how_the_real_snapshot_names_jobs(charlie, secret_job, cpu_fleet):
    """The reasons come from scheduler.framework.job_label -> Jobs.name(j), the name jobs.snapshot
    gives each job: redaction must recognize exactly that form (a change there would leak)."""
    from django.utils import timezone

    from jobs.selectors import job_names_redacted
    from jobs.snapshot import snapshot_build

    snap = snapshot_build(now=timezone.now()).snapshot
    j = [int(i) for i in snap.jobs.ids].index(secret_job.pk)
    reason = f"waiting for approval to preempt job {snap.jobs.name(j)} (Standard)"

    assert SECRET in reason
    assert job_names_redacted(user=charlie, texts=[reason]) == [
        f"waiting for approval to preempt job #{secret_job.pk} (another team's job) (Standard)"]
