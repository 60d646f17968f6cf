"""Fixtures for the jobs tests that play agents and the tick against the database."""
import os

import pytest


@pytest.fixture
def short_policy(monkeypatch):
    """Returns the enrollment token after setting a policy a test can act under at once: nodes enroll
    with that token, a job may be preempted or moved right after it starts (no minimum run), and
    usage is accounted on every tick. A test module adds what it needs on top (autouse)."""
    monkeypatch.setenv("MERIDIAN_AGENT_ENROLLMENT_TOKEN", "test-enrollment-token")
    monkeypatch.setenv("MERIDIAN_MIN_RUN_SECONDS", "0")
    monkeypatch.setenv("MERIDIAN_ACCOUNTING_SECONDS", "0")
    return os.environ["MERIDIAN_AGENT_ENROLLMENT_TOKEN"]
