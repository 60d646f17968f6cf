"""Finding Medium 7 (issue 15): brute-force protection on every password login.

django-axes (portal.auth) counts failures per account and per address; at
MERIDIAN_LOGIN_FAILURE_LIMIT failures the account (or the address) is refused for
MERIDIAN_LOGIN_LOCKOUT_MINUTES, even with the right password, with a 429 and a message.
Before, 40 wrong passwords then the right one logged in."""
import pytest
from django.test import Client
from rest_framework.test import APIClient

LIMIT = 3


@pytest.fixture(autouse=True)
def login_limits(settings):
    settings.MERIDIAN_LOGIN_FAILURE_LIMIT = LIMIT


def _token(client, password, username="alice", address="10.0.0.1"):
    return client.post("/api/auth/token/", {"username": username, "password": password}, format="json",
                       REMOTE_ADDR=address)


def test_the_token_endpoint_locks_an_account_after_failures(alice):
    client = APIClient()
    for _ in range(LIMIT - 1):
        response = _token(client, "wrong")
        assert response.status_code == 400 and "wrong username or password" in str(response.json())

    locked = _token(client, "wrong")
    right_password = _token(client, "alice-demo-pass")

    assert locked.status_code == 429
    assert right_password.status_code == 429
    assert "too many failed logins" in right_password.json()["detail"]
    assert "minutes" in right_password.json()["detail"]


def test_the_account_is_locked_from_another_address_too(alice):
    client = APIClient()
    for number in range(LIMIT):
        _token(client, "wrong", address=f"10.0.1.{number}")

    assert _token(client, "alice-demo-pass", address="10.9.9.9").status_code == 429


def test_an_address_is_locked_across_accounts(alice, bob):
    client = APIClient()
    for username in ("nobody1", "nobody2", "nobody3"):
        _token(client, "wrong", username=username, address="10.0.2.1")

    assert _token(client, "bob-demo-pass", username="bob", address="10.0.2.1").status_code == 429
    assert _token(client, "bob-demo-pass", username="bob", address="10.0.2.2").status_code == 200


def test_the_login_page_locks_out_with_a_message(alice):
    client = Client(REMOTE_ADDR="10.0.3.1")
    for _ in range(LIMIT):
        client.post("/accounts/login/", {"username": "alice", "password": "wrong"})

    response = client.post("/accounts/login/", {"username": "alice", "password": "alice-demo-pass"})

    assert response.status_code == 429
    assert "too many failed logins" in response.content.decode()
    assert "_auth_user_id" not in client.session


def test_the_admin_login_locks_out(admin_user):
    client = Client(REMOTE_ADDR="10.0.4.1")
    for _ in range(LIMIT):
        client.post("/admin/login/", {"username": "admin", "password": "wrong"})

    response = client.post("/admin/login/?next=/admin/", {"username": "admin", "password": "admin-demo-pass"})

    assert response.status_code == 429
    assert "_auth_user_id" not in client.session
