"""The live-log end-to-end tests run on the e2e stack (tests/e2e/harness.py)."""
import os
import pathlib
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "e2e"))

from harness import ControlPlane, prepare_database  # noqa: E402


@pytest.fixture(scope="session")
def template_db():
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="mer-logs-db-"))
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
    base = pathlib.Path(tempfile.mkdtemp(prefix="mer-logs-", dir="/tmp"))

    def start(env=None):
        plane = ControlPlane(base / f"cp{len(started)}", env=env)
        started.append(plane)
        return plane.start(template_db=template_db)

    yield start
    for plane in started:
        plane.stop()
    shutil.rmtree(base, ignore_errors=True)
