import json

from django.contrib.auth import authenticate
from django.core.management import call_command

from fleet.models import Accelerator, Node
from jobs.models import Membership


def test_demo_seed_makes_the_cast_and_the_cpu_fleet_and_is_idempotent(db, capsys):
    call_command("demo_seed")
    call_command("demo_seed")

    assert Node.objects.count() == 4 and Accelerator.objects.filter(type="CPU").count() == 16
    assert authenticate(username="carol", password="carol-demo-pass") is not None
    roles = set(Membership.objects.values_list("user__username", "team__slug", "role"))
    assert ("carol", "team-a", "capacity_manager") in roles and ("charlie", "team-b", "member") in roles
    assert not any(user == "charlie" and team == "team-a" for user, team, _ in roles)


def test_fleet_node_token_prints_tokens_that_authenticate(db, capsys):
    from fleet.selectors import node_get_by_token

    call_command("demo_seed")
    capsys.readouterr()
    call_command("fleet_node_token", "--region", "demo-east")

    tokens = json.loads(capsys.readouterr().out)
    assert sorted(tokens) == ["demo-east-c0-n0", "demo-east-c1-n0"]
    assert all(node_get_by_token(token=t).hostname == h for h, t in tokens.items())
