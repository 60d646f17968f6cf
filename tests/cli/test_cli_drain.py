"""`meridian drain NODE --reason ...` and `meridian undrain NODE` against a real control plane
(pytest-django's live_server: real HTTP, the real API and services): by hostname or id, --json,
and the errors an operator meets (each a clear message and exit code 1)."""
import io
import json

import pytest

from cli.main import main
from fleet.models import Node
from fleet.services import fleet_generate

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("MERIDIAN_URL", raising=False)
    monkeypatch.delenv("MERIDIAN_TOKEN", raising=False)


@pytest.fixture
def nodes(db):
    fleet_generate(regions=1, clusters=1, nodes=2, devices=2, accelerator_type="CPU", prefix="cli")
    return list(Node.objects.order_by("hostname"))


def login(live_server, monkeypatch, username, password):
    monkeypatch.setattr("sys.stdin", io.StringIO(password + "\n"))
    assert main(["login", live_server.url, "--username", username, "--password-stdin"]) == 0


def run(capsys, *argv):
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_an_admin_drains_by_hostname_and_undrains_by_id(live_server, cast, nodes, monkeypatch, capsys):
    login(live_server, monkeypatch, "admin", "admin-demo-pass")
    first = nodes[0]
    code, out, err = run(capsys, "drain", first.hostname, "--reason", "replace GPU 1")
    assert code == 0, err
    assert f"node {first.hostname} (id {first.pk}) is draining: replace GPU 1 (by admin" in out
    assert "0 job(s) still hold devices there" in out
    first.refresh_from_db()
    assert (first.state, first.drain_reason, first.drained_by) == (Node.State.DRAINING, "replace GPU 1", "admin")
    code, out, _ = run(capsys, "drain", "--json", first.hostname, "--reason", "again")
    assert code == 0 and json.loads(out)["drain_reason"] == "replace GPU 1"  # idempotent: the first drain stays
    code, out, err = run(capsys, "undrain", "--json", str(first.pk))
    assert code == 0, err
    body = json.loads(out)
    assert (body["hostname"], body["state"], body["drain_reason"]) == (first.hostname, "ready", "")
    assert Node.objects.get(pk=nodes[1].pk).state == Node.State.READY  # the other node untouched


def test_drain_errors_name_what_to_fix(live_server, cast, nodes, monkeypatch, capsys):
    login(live_server, monkeypatch, "admin", "admin-demo-pass")
    code, out, err = run(capsys, "drain", "--json", "no-such-host", "--reason", "x")
    assert code == 1 and "no node named 'no-such-host'" in err and json.loads(out)["error"]
    code, _, err = run(capsys, "drain", "999999", "--reason", "x")
    assert code == 1 and "HTTP 404" in err and "no node 999999" in err
    code, _, err = run(capsys, "drain", nodes[0].hostname, "--reason", "   ")
    assert code == 1 and "HTTP 400" in err and "say why" in err
    Node.objects.filter(pk=nodes[1].pk).update(state=Node.State.LOST)
    code, _, err = run(capsys, "drain", nodes[1].hostname, "--reason", "x")
    assert code == 1 and "HTTP 409" in err and "a lost node cannot be drained" in err
    with pytest.raises(SystemExit) as usage:
        run(capsys, "drain", nodes[0].hostname)
    assert usage.value.code == 2 and "--reason" in capsys.readouterr().err
    assert Node.objects.get(pk=nodes[0].pk).state == Node.State.READY


def test_a_teams_capacity_manager_may_not_drain(live_server, cast, nodes, monkeypatch, capsys):
    login(live_server, monkeypatch, "carol", "carol-demo-pass")
    code, _, err = run(capsys, "drain", nodes[0].hostname, "--reason", "mine")
    assert code == 1 and "HTTP 403" in err and "only global admins may drain nodes" in err
    code, _, err = run(capsys, "undrain", nodes[0].hostname)
    assert code == 1 and "HTTP 403" in err
    assert Node.objects.get(pk=nodes[0].pk).state == Node.State.READY
