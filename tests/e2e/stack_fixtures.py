"""The e2e stack's fixtures (a migrated template database; a factory of control planes), shared by
every test folder that runs real control planes and agents (tests/e2e, tests/logs)."""
import os
import pathlib
import shutil
import tempfile

import pytest
from harness import ControlPlane, prepare_database


@pytest.fixture(scope="session")
def template_db():
    """A migrated SQLite file with the demo cast, copied by every test (migrating costs ~10 s)."""
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="mer-e2e-db-"))
    env = dict(os.environ)
    env.update({"MERIDIAN_DATA_DIR": str(scratch), "DATABASE_URL": f"sqlite:///{scratch / 'db.sqlite3'}",
                "DJANGO_SETTINGS_MODULE": "portal.settings"})
    env.pop("MERIDIAN_PROFILE", None)
    prepare_database(env)
    yield scratch / "db.sqlite3"
    shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture
def stack(template_db):
    """Returns a factory: stack(env={...}) -> a started ControlPlane, stopped after the test."""
    started = []
    # short paths: the launchers' control sockets must fit in 107 bytes
    base = pathlib.Path(tempfile.mkdtemp(prefix="mer-e2e-", dir="/tmp"))
    os.chmod(base, 0o711)  # passable by job uids (a sandboxed agent's jobs), not listable

    def start(env=None):
        plane = ControlPlane(base / f"cp{len(started)}", env=env)
        started.append(plane)
        return plane.start(template_db=template_db)

    yield start
    for plane in started:
        plane.stop()
    shutil.rmtree(base, ignore_errors=True)
