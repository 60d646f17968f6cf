def test_teams_show_role_quota_and_usage_in_constant_queries(
    api_client_for, carol, submit, team_a, team_b, django_assert_max_num_queries
):
    submit(team_a, carol, world_size=4, min_devices=2)
    submit(team_b, carol, world_size=8, min_devices=8)

    with django_assert_max_num_queries(4):
        teams = api_client_for(carol).get("/api/teams/").json()["results"]

    by_slug = {t["slug"]: t for t in teams}
    assert by_slug["team-a"]["role"] == "capacity_manager"
    assert by_slug["team-a"]["usage"]["CPU"] == {"quota": 64, "claimed": 2, "devices_in_use": 0, "jobs": 1}
    assert by_slug["team-b"]["usage"]["CPU"]["claimed"] == 8


def test_charlie_sees_only_team_b(api_client_for, charlie):
    assert [t["slug"] for t in api_client_for(charlie).get("/api/teams/").json()["results"]] == ["team-b"]
