"""GET /api/jobs/ and /api/jobs/<id>/: a user sees exactly their teams' jobs; another
team's job is a 404; filters work; a page costs a fixed number of queries."""
import pytest

from jobs.models import Job


def test_members_see_their_teams_jobs_and_nothing_else(api_client_for, submit, alice, bob, charlie, team_a, team_b):
    a_job = submit(team_a, alice)
    b_job = submit(team_b, charlie)

    assert [j["id"] for j in api_client_for(bob).get("/api/jobs/").json()["results"]] == [a_job.pk]
    assert [j["id"] for j in api_client_for(charlie).get("/api/jobs/").json()["results"]] == [b_job.pk]


def test_charlie_gets_404_for_team_as_job_everywhere(api_client_for, submit, alice, charlie, team_a):
    job = submit(team_a, alice)
    client = api_client_for(charlie)

    for url in (f"/api/jobs/{job.pk}/", f"/api/jobs/{job.pk}/events/"):
        assert client.get(url).status_code == 404, url
    assert client.post(f"/api/jobs/{job.pk}/cancel/").status_code == 404
    assert client.get("/api/jobs/", {"team": "team-a"}).json()["results"] == []
    assert Job.objects.get(pk=job.pk).state == Job.State.PENDING


def test_a_global_admin_sees_every_job(api_client_for, submit, alice, charlie, admin_user, team_a, team_b):
    submit(team_a, alice)
    submit(team_b, charlie)

    assert api_client_for(admin_user).get("/api/jobs/").json()["count"] == 2


def test_it_filters_by_state_tier_team_and_type(api_client_for, submit, carol, team_a, team_b):
    premium = submit(team_a, carol, tier="premium")
    submit(team_a, carol, tier="basic")
    other_team = submit(team_b, carol, tier="premium")
    cancelled = submit(team_a, carol, tier="premium")
    Job.objects.filter(pk=cancelled.pk).update(state=Job.State.CANCELLED)
    client = api_client_for(carol)

    def ids(**params):
        return sorted(j["id"] for j in client.get("/api/jobs/", params).json()["results"])

    assert ids(tier="premium", team="team-a", state="pending") == [premium.pk]
    assert ids(team=str(team_b.pk)) == [other_team.pk]
    assert ids(accelerator_type="H100-80GB") == []
    assert ids(state="cancelled") == [cancelled.pk]


@pytest.mark.parametrize(
    ("params", "message"),
    [({"state": "sleeping"}, 'unknown state "sleeping"'), ({"tier": "gold"}, 'unknown tier "gold"'),
     ({"accelerator_type": "TPU"}, 'unknown accelerator type "TPU"')],
    ids=["state", "tier", "type"],
)
def test_an_unknown_filter_value_is_a_400(api_client_for, alice, params, message):
    response = api_client_for(alice).get("/api/jobs/", params)

    assert response.status_code == 400
    assert message in str(response.json())


def test_the_list_is_paginated(api_client_for, submit, alice, team_a):
    for _ in range(3):
        submit(team_a, alice)

    body = api_client_for(alice).get("/api/jobs/", {"page_size": 2}).json()

    assert (body["count"], len(body["results"]), body["next"] is not None) == (3, 2, True)


def test_listing_jobs_costs_the_same_queries_for_many_jobs(
    api_client_for, submit, alice, team_a, django_assert_max_num_queries
):
    for _ in range(30):
        submit(team_a, alice)
    client = api_client_for(alice)

    # count + page (jobs joined with team, submitter and region in one query)
    with django_assert_max_num_queries(2):
        response = client.get("/api/jobs/", {"page_size": 30})
    assert len(response.json()["results"]) == 30


def test_the_event_list_is_the_timeline(api_client_for, submit, alice, bob, team_a, django_assert_max_num_queries):
    job = submit(team_a, alice)
    api_client_for(bob).post(f"/api/jobs/{job.pk}/cancel/")

    with django_assert_max_num_queries(4):
        events = api_client_for(alice).get(f"/api/jobs/{job.pk}/events/").json()["results"]

    assert [(e["type"], e["to_state"], e["actor"]) for e in events] == [
        ("submitted", "pending", "alice"),
        ("state_changed", "cancelled", "bob"),
    ]
