"""POST /api/jobs/bulk/ (Slurm's --array): all or nothing, each bad spec named by its index, a
bound on the count, the quota checked for all the jobs together; the answer of POST /api/jobs/
is the job as the list shows it."""
import pytest

from jobs.models import Job, JobEvent, Replica, TeamQuotaClaim

URL = "/api/jobs/bulk/"
pytestmark = pytest.mark.django_db


def _spec(job_spec, **overrides):
    spec = job_spec(**overrides)
    spec.pop("team", None)
    return spec


def test_it_submits_every_job_with_its_replicas_and_events(api_client_for, alice, team_a, job_spec):
    team_a.quotas = {"CPU": 1000}
    team_a.save()
    specs = [_spec(job_spec, name=f"sweep-{i}", world_size=4, min_devices=2) for i in range(50)]
    response = api_client_for(alice).post(URL, {"jobs": specs}, format="json")

    assert response.status_code == 201, response.content
    body = response.json()
    assert body["count"] == 50 and [job["name"] for job in body["jobs"]] == [f"sweep-{i}" for i in range(50)]
    ids = [job["id"] for job in body["jobs"]]
    assert set(Job.objects.filter(pk__in=ids).values_list("state", flat=True)) == {"pending"}
    assert Replica.objects.filter(job_id__in=ids).count() == 200
    assert JobEvent.objects.filter(job_id__in=ids, type=JobEvent.Type.SUBMITTED, actor=alice).count() == 50
    assert TeamQuotaClaim.objects.get(team=team_a, accelerator_type="CPU").claimed == 100


def test_one_bad_spec_submits_nothing_and_is_named_by_index(api_client_for, alice, job_spec):
    specs = [_spec(job_spec) for _ in range(5)]
    specs[1]["world_size"] = 0
    specs[3] = {**specs[3], "min_devices": 3, "colour": "red"}
    response = api_client_for(alice).post(URL, {"jobs": specs}, format="json")

    assert response.status_code == 400, response.content
    errors = response.json()["jobs"]
    assert set(errors) == {"1", "3"}
    assert "world_size" in errors["1"]
    assert "colour" in str(errors["3"]) and "min_devices" in errors["3"]
    assert Job.objects.count() == 0 and TeamQuotaClaim.objects.filter(claimed__gt=0).count() == 0


def test_each_job_of_a_bulk_submission_has_its_own_resume_policy_and_a_bad_one_is_named(api_client_for, alice,
                                                                                         job_spec):
    specs = [_spec(job_spec, name="a", if_resume_refused="restart"), _spec(job_spec, name="b")]
    refused = api_client_for(alice).post(URL, {"jobs": [*specs, _spec(job_spec, if_resume_refused="again")]},
                                         format="json")

    assert refused.status_code == 400
    assert "if_resume_refused must be one of fail, restart" in refused.json()["jobs"]["2"]["if_resume_refused"][0]
    assert Job.objects.count() == 0
    response = api_client_for(alice).post(URL, {"jobs": specs}, format="json")
    assert response.status_code == 201, response.content
    assert dict(Job.objects.values_list("name", "if_resume_refused")) == {"a": "restart", "b": "fail"}


def test_the_quota_is_checked_for_all_the_jobs_together(api_client_for, alice, team_a, job_spec):
    team_a.quotas = {"CPU": 10}
    team_a.save()
    response = api_client_for(alice).post(URL, {"jobs": [_spec(job_spec, min_devices=2)] * 6}, format="json")

    assert response.status_code == 400
    assert "these 6 jobs need 12 more" in response.json()["min_devices"][0]
    assert Job.objects.count() == 0
    assert api_client_for(alice).post(URL, {"jobs": [_spec(job_spec, min_devices=2)] * 5},
                                      format="json").status_code == 201


def test_the_count_is_bounded(api_client_for, alice, job_spec, settings):
    settings.MERIDIAN_MAX_BULK_JOBS = 3
    response = api_client_for(alice).post(URL, {"jobs": [_spec(job_spec)] * 4}, format="json")
    assert response.status_code == 400 and "at most 3 jobs" in str(response.json()["jobs"])
    settings.MERIDIAN_MAX_BULK_RANKS = 7
    response = api_client_for(alice).post(URL, {"jobs": [_spec(job_spec, world_size=4)] * 2}, format="json")
    assert response.status_code == 400 and "8 ranks in all" in str(response.json()["jobs"])
    assert Job.objects.count() == 0


@pytest.mark.parametrize("body, field", [
    ({"jobs": []}, "jobs"),
    ({"jobs": "many"}, "jobs"),
    ({"jobs": [1, 2]}, "jobs"),
    ({}, "jobs"),
    ({"jobs": [{}], "extra": 1}, "non_field_errors"),
], ids=["empty", "not-a-list", "not-objects", "missing", "unknown-field"])
def test_malformed_bodies_are_400s(api_client_for, alice, body, field):
    response = api_client_for(alice).post(URL, body, format="json")
    assert response.status_code == 400 and field in response.json(), response.content


def test_another_teams_bulk_is_refused(api_client_for, alice, job_spec):
    response = api_client_for(alice).post(URL, {"team": "team-b", "jobs": [_spec(job_spec)]}, format="json")
    assert response.status_code == 400 and "not on a team" in response.json()["team"][0]


def test_the_single_submit_answers_the_job_as_the_detail_shows_it(api_client_for, alice, job_spec):
    client = api_client_for(alice)
    created = client.post("/api/jobs/", job_spec(), format="json").json()
    detail = client.get(f"/api/jobs/{created['id']}/").json()
    assert created == detail
