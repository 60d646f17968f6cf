"""Fixtures for the runtime tests (helpers live in runtime_helpers.py)."""
import pytest


@pytest.fixture(autouse=True)
def _spool_root(tmp_path_factory, monkeypatch):
    """Every test gets its own spool root (MERIDIAN_SPOOL_ROOT), never /run/meridian."""
    root = tmp_path_factory.mktemp("spool")
    monkeypatch.setenv("MERIDIAN_SPOOL_ROOT", str(root))
    yield root


@pytest.fixture
def jobs():
    """Yields a list to append runtime_helpers.Job objects to; kills what still runs at the end."""
    started = []
    yield started
    for job in started:
        job.kill()


@pytest.fixture(scope="session")
def reference_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("reference")
