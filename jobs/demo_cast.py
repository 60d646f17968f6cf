"""The demo cast: the same people in the tests (tests/conftest.py) and the demo
(`manage.py demo_seed`). Passwords are for the local demo only; see the README."""
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.db import transaction

from jobs.models import Membership, Team
from jobs.services import membership_set

DEMO_QUOTAS = {"CPU": 64, "H100-80GB": 1024, "H200-141GB": 512, "A100-80GB": 512, "A100-40GB": 256, "V100-32GB": 256}
DEMO_PASSWORDS = {
    "alice": "alice-demo-pass",
    "bob": "bob-demo-pass",
    "charlie": "charlie-demo-pass",
    "carol": "carol-demo-pass",
    "admin": "admin-demo-pass",
}


@dataclass
class Cast:
    team_a: Team
    team_b: Team
    alice: object
    bob: object
    charlie: object
    carol: object
    admin: object


def _user(username, *, superuser=False):
    User = get_user_model()
    user, created = User.objects.get_or_create(
        username=username,
        defaults={"email": f"{username}@example.com", "is_staff": superuser, "is_superuser": superuser},
    )
    if created:
        user.set_password(DEMO_PASSWORDS[username])
        user.save(update_fields=["password"])
    return user


def cast_create(*, quotas=None):
    """Returns the cast, creating whatever of it does not exist yet (idempotent)."""
    quotas = quotas or DEMO_QUOTAS
    with transaction.atomic():
        team_a, _ = Team.objects.get_or_create(slug="team-a", defaults={"name": "Team A", "quotas": quotas})
        team_b, _ = Team.objects.get_or_create(slug="team-b", defaults={"name": "Team B", "quotas": quotas})
        cast = Cast(
            team_a=team_a,
            team_b=team_b,
            alice=_user("alice"),
            bob=_user("bob"),
            charlie=_user("charlie"),
            carol=_user("carol"),
            admin=_user("admin", superuser=True),
        )
        membership_set(team=team_a, user=cast.alice, role=Membership.Role.MEMBER)
        membership_set(team=team_a, user=cast.bob, role=Membership.Role.MEMBER)
        membership_set(team=team_b, user=cast.charlie, role=Membership.Role.MEMBER)
        membership_set(team=team_a, user=cast.carol, role=Membership.Role.CAPACITY_MANAGER)
        membership_set(team=team_b, user=cast.carol, role=Membership.Role.CAPACITY_MANAGER)
    return cast
