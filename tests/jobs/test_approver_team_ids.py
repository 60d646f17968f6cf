"""approver_team_ids: the one rule for who decides a team's preemptions (API, pages, sockets, services)."""
import pytest
from django.contrib.auth.models import AnonymousUser

from jobs.models import Membership
from jobs.selectors import approver_team_ids
from jobs.services import user_can_approve_preemptions


@pytest.mark.parametrize(
    ("who", "teams"),
    [("alice", set()), ("bob", set()), ("charlie", set()), ("carol", {"a", "b"}), ("admin", {"a", "b"})],
    ids=["member-alice", "member-bob", "member-charlie", "capacity-manager-carol", "global-admin"],
)
def test_capacity_managers_and_admins_decide_their_teams(cast, who, teams):
    user = cast.admin if who == "admin" else getattr(cast, who)
    expected = {getattr(cast, f"team_{t}").pk for t in teams}
    assert approver_team_ids(user=user) == expected
    for team in (cast.team_a, cast.team_b):
        assert user_can_approve_preemptions(user=user, team_id=team.pk) is (team.pk in expected)


def test_a_team_admin_decides_that_team_only(cast):
    Membership.objects.filter(user=cast.charlie, team=cast.team_b).update(role=Membership.Role.ADMIN)
    assert approver_team_ids(user=cast.charlie) == {cast.team_b.pk}


def test_nobody_anonymous_decides_anything(db):
    assert approver_team_ids(user=AnonymousUser()) == set()
    assert approver_team_ids(user=None) == set()
