"""The meridian CLI against a real control plane (pytest-django's live_server: real HTTP, the
real API and services, no agents): login, submit from a folder, status, events, cancel, wait,
download, and the errors a user meets (each a clear message and a non-zero exit)."""
import json
import os
import stat

import pytest

from cli.client import Client, CliError, config_path
from cli.commands import job_exit_code, split_command
from cli.main import main

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch, settings):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("MERIDIAN_URL", raising=False)
    monkeypatch.delenv("MERIDIAN_TOKEN", raising=False)
    settings.MERIDIAN_CHECKPOINT_STORE = str(tmp_path / "store")
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def project(tmp_path):
    root = tmp_path / "proj"
    (root / "data").mkdir(parents=True)
    (root / "train.py").write_text("print('hi')\n")
    (root / "data" / "in.txt").write_text("1\n")
    return root


@pytest.fixture
def logged_in(live_server, cast, monkeypatch):
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("alice-demo-pass\n"))
    assert main(["login", live_server.url, "--username", "alice", "--password-stdin"]) == 0
    return live_server.url


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_login_saves_the_token_with_mode_600(logged_in, capsys):
    saved = json.loads(config_path().read_text())
    assert saved["url"] == logged_in and saved["username"] == "alice" and len(saved["token"]) == 40
    assert stat.S_IMODE(config_path().stat().st_mode) == 0o600


def test_a_wrong_password_is_a_clear_error(live_server, cast, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("nope\n"))
    code, _, err = run(capsys, "login", live_server.url, "--username", "alice", "--password-stdin")
    assert code == 1 and "wrong username or password" in err and not config_path().exists()


def test_without_a_login_every_command_says_how_to_log_in(capsys):
    code, out, err = run(capsys, "status", "--json")
    assert code == 1 and "meridian login URL" in err and json.loads(out)["error"]


def test_environment_variables_override_the_saved_login(logged_in, monkeypatch, capsys):
    monkeypatch.setenv("MERIDIAN_TOKEN", "0" * 40)
    code, _, err = run(capsys, "status")
    assert code == 1 and "refused the token" in err


def test_submit_status_events_cancel_wait_from_a_folder(logged_in, project, monkeypatch, capsys):
    monkeypatch.chdir(project)
    code, out, err = run(capsys, "submit", "--json", "--ranks", "2", "--tier", "basic", "--env", "LR=0.1", "--",
                         "python", "train.py", "--epochs", "3")
    assert code == 0, err
    submitted = json.loads(out)
    assert submitted["uploaded"] is True and submitted["url"].endswith(f"/jobs/{submitted['id']}/")
    job = Client.from_config().get(f"/api/jobs/{submitted['id']}/")
    assert (job["entrypoint"], job["args"], job["env"], job["bundle"]) == (
        "train.py", ["--epochs", "3"], {"LR": "0.1"}, submitted["bundle"])
    code, out, _ = run(capsys, "submit", "--json", "--", "python", "train.py")
    assert json.loads(out)["uploaded"] is False  # same folder, same digest: not sent again
    code, out, _ = run(capsys, "status")
    assert code == 0 and "STATE" in out and "pending" in out and "proj" in out
    code, out, _ = run(capsys, "events", str(submitted["id"]))
    assert code == 0 and "submitted" in out
    code, out, _ = run(capsys, "cancel", str(submitted["id"]))
    assert code == 0 and "cancelled" in out
    code, out, _ = run(capsys, "wait", "--json", str(submitted["id"]))
    assert code == 4 and json.loads(out)["state"] == "cancelled"
    code, _, err = run(capsys, "download", str(submitted["id"]))
    assert code == 1 and "no saved outputs yet" in err


def test_submit_lets_a_job_start_again_from_scratch_when_its_resume_is_refused(logged_in, project, monkeypatch,
                                                                             capsys):
    monkeypatch.chdir(project)
    code, out, err = run(capsys, "submit", "--json", "--if-resume-refused", "restart", "--", "python", "train.py")
    assert code == 0, err
    assert Client.from_config().get(f"/api/jobs/{json.loads(out)['id']}/")["if_resume_refused"] == "restart"
    code, out, err = run(capsys, "submit", "--json", "--", "python", "train.py")
    assert Client.from_config().get(f"/api/jobs/{json.loads(out)['id']}/")["if_resume_refused"] == "fail"
    with pytest.raises(SystemExit) as refused:
        run(capsys, "submit", "--if-resume-refused", "retry", "--", "python", "train.py")
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "--if-resume-refused: invalid choice" in err and "restart" in err


def test_submit_asks_for_the_host_network_which_the_server_grants_only_where_allowed(logged_in, project, monkeypatch,
                                                                                    capsys, settings):
    monkeypatch.chdir(project)
    code, out, err = run(capsys, "submit", "--network", "host", "--", "python", "train.py")
    assert code == 1 and "MERIDIAN_JOB_HOST_NETWORK" in err  # the server's 400, naming the setting
    settings.MERIDIAN_JOB_HOST_NETWORK = "allow"
    code, out, err = run(capsys, "submit", "--json", "--network", "host", "--", "python", "train.py")
    assert code == 0, err
    assert Client.from_config().get(f"/api/jobs/{json.loads(out)['id']}/")["network"] == "host"
    code, out, err = run(capsys, "submit", "--json", "--", "python", "train.py")
    assert Client.from_config().get(f"/api/jobs/{json.loads(out)['id']}/")["network"] == "isolated"


def test_wait_gives_up_after_its_timeout_with_124(logged_in, project, monkeypatch, capsys):
    monkeypatch.chdir(project)
    _, out, _ = run(capsys, "submit", "--json", "--", "python", "train.py")
    code, _, err = run(capsys, "wait", str(json.loads(out)["id"]), "--timeout", "0.2", "--interval", "0.1")
    assert code == 124 and "still pending" in err


def test_submit_errors_name_what_to_fix(logged_in, project, monkeypatch, capsys):
    monkeypatch.chdir(project)
    code, _, err = run(capsys, "submit", "--", "python", "missing.py")
    assert code == 1 and "missing.py is not a file" in err
    code, _, err = run(capsys, "submit", "--exclude", "train.py", "--", "python", "train.py")
    assert code == 1 and "--include train.py" in err
    (project / "big.bin").write_bytes(b"\0" * 4000)
    code, _, err = run(capsys, "submit", "--max-bundle-bytes", "1000", "--", "python", "train.py")
    assert code == 1 and "big.bin" in err
    code, _, err = run(capsys, "submit", "--ranks", "3", "--min-devices", "2", "--", "python", "train.py")
    assert code == 1 and "min_devices" in err  # the server's 400, naming the field
    code, _, err = run(capsys, "status", "99999")
    assert code == 1 and "HTTP 404" in err


def test_split_command_and_exit_codes():
    assert split_command(["--", "python3", "train.py", "--lr", "1"]) == ("train.py", ["--lr", "1"])
    assert split_command(["train.py"]) == ("train.py", [])
    with pytest.raises(CliError, match="say what to run"):
        split_command(["--"])
    assert job_exit_code({"state": "succeeded"}) == 0
    assert job_exit_code({"state": "failed", "exit_code": 3}) == 3
    assert job_exit_code({"state": "failed", "exit_code": None}) == 1
    assert job_exit_code({"state": "cancelled"}) == 4


def test_the_console_script_is_declared():
    import tomllib
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml"), "rb") as handle:
        scripts = tomllib.load(handle)["project"]["scripts"]
    assert scripts == {"meridian": "cli.main:main", "meridian-run": "runtime.launcher:main",
                       "meridian-agent": "agent.main:main"}
