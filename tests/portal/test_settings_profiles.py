"""Settings come from the environment. Each case imports portal.settings in a fresh
interpreter with a given environment and reports what it saw."""
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, sys
from django.conf import settings
import django
django.setup()
from django.db import connection
out = {k: getattr(settings, k) for k in sys.argv[1:]}
out["_db_engine"] = settings.DATABASES["default"]["ENGINE"]
out["_db_name"] = str(settings.DATABASES["default"]["NAME"])
if out["_db_engine"].endswith("sqlite3"):
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode")
        out["_journal_mode"] = cursor.fetchone()[0]
print(json.dumps(out, default=str))
"""


def settings_with(env, *names, data_dir):
    clean = {k: v for k, v in os.environ.items() if k not in {
        "DATABASE_URL", "REDIS_URL", "SECRET_KEY", "MERIDIAN_PROFILE", "ALLOWED_HOSTS"}}
    clean.update({"DJANGO_SETTINGS_MODULE": "portal.settings", "MERIDIAN_DATA_DIR": str(data_dir), **env})
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *names], cwd=ROOT, env=clean, capture_output=True, text=True
    )
    return result


def test_the_default_is_sqlite_in_the_data_dir_with_wal(tmp_path):
    result = settings_with({}, "DEBUG", "REDIS_URL", "CELERY_BROKER_URL", data_dir=tmp_path)

    seen = json.loads(result.stdout)
    assert seen["_db_name"] == str(tmp_path / "meridian.sqlite3")
    assert seen["_journal_mode"] == "wal"
    assert seen["DEBUG"] is True
    assert seen["REDIS_URL"] == f"unix://{tmp_path}/redis.sock?db=0"
    assert seen["CELERY_BROKER_URL"] == f"redis+socket://{tmp_path}/redis.sock?virtual_host=0"


def test_the_secret_key_is_generated_once_with_mode_600(tmp_path):
    first = json.loads(settings_with({}, "SECRET_KEY", data_dir=tmp_path).stdout)["SECRET_KEY"]
    second = json.loads(settings_with({}, "SECRET_KEY", data_dir=tmp_path).stdout)["SECRET_KEY"]

    key_file = tmp_path / "secret_key"
    assert first == second == key_file.read_text().strip()
    assert len(first) >= 50
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600


def test_a_secret_key_from_the_environment_wins_and_nothing_is_written(tmp_path):
    seen = json.loads(settings_with({"SECRET_KEY": "k" * 60}, "SECRET_KEY", data_dir=tmp_path).stdout)

    assert seen["SECRET_KEY"] == "k" * 60
    assert not (tmp_path / "secret_key").exists()


def test_database_and_redis_urls_come_from_the_environment(tmp_path):
    env = {"DATABASE_URL": "postgres://meridian@db.example:5432/meridian", "REDIS_URL": "redis://cache.example:6380/2"}

    seen = json.loads(
        settings_with(env, "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "CHANNEL_LAYERS", data_dir=tmp_path).stdout
    )

    assert (seen["_db_engine"], seen["_db_name"]) == ("django.db.backends.postgresql", "meridian")
    assert seen["CELERY_BROKER_URL"] == seen["CELERY_RESULT_BACKEND"] == "redis://cache.example:6380/2"
    assert seen["CHANNEL_LAYERS"]["default"]["CONFIG"]["hosts"] == ["redis://cache.example:6380/2"]


def test_production_turns_debug_off_and_cookies_secure(tmp_path):
    env = {"MERIDIAN_PROFILE": "production", "ALLOWED_HOSTS": "meridian.example.com", "SECRET_KEY": "s" * 60}

    seen = json.loads(settings_with(
        env, "DEBUG", "ALLOWED_HOSTS", "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE", "SECURE_HSTS_SECONDS",
        "SECURE_SSL_REDIRECT", data_dir=tmp_path).stdout)

    assert seen["DEBUG"] is False
    assert seen["ALLOWED_HOSTS"] == ["meridian.example.com"]
    assert seen["SESSION_COOKIE_SECURE"] is seen["CSRF_COOKIE_SECURE"] is True
    assert seen["SECURE_HSTS_SECONDS"] >= 31536000
    assert seen["SECURE_SSL_REDIRECT"] is True


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MERIDIAN_PROFILE": "production"}, "MERIDIAN_PROFILE=production needs ALLOWED_HOSTS"),
        ({"MERIDIAN_PROFILE": "staging"}, "MERIDIAN_PROFILE='staging' is not known"),
    ],
    ids=["production-without-hosts", "unknown-profile"],
)
def test_a_bad_profile_fails_at_start_with_a_clear_message(tmp_path, env, message):
    result = settings_with(env, "DEBUG", data_dir=tmp_path)

    assert result.returncode != 0
    assert message in result.stderr


def test_processes_starting_at_once_agree_on_one_whole_secret_key(tmp_path):
    """The web server, workers and beat start together on a fresh data dir: none may read a
    key file that exists but is not written yet (CI saw a worker die on an empty one)."""
    from portal.settings import _secret_key_from_data_dir

    def read_key(start, data_dir, keys, errors):
        start.wait()
        try:
            keys.append(_secret_key_from_data_dir(data_dir))
        except Exception as error:  # noqa: BLE001 — any failure is the defect under test
            errors.append(error)

    for round_ in range(30):
        data_dir = tmp_path / str(round_)
        data_dir.mkdir()
        start = threading.Barrier(8)
        keys, errors = [], []
        threads = [threading.Thread(target=read_key, args=(start, data_dir, keys, errors)) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        assert errors == []
        assert len(set(keys)) == 1 and keys[0] == (data_dir / "secret_key").read_text().strip()
        assert sorted(p.name for p in data_dir.iterdir()) == ["secret_key"]
