"""Fixtures for the jobs tests that play agents and the tick against the database."""
import pytest

ENROLLMENT_TOKEN = "test-enrollment-token"


@pytest.fixture
def short_policy(settings):
    """Returns the enrollment token after setting a policy a test can act under at once: nodes enroll
    with that token, a job may be preempted or moved right after it starts (no minimum run), and
    usage is accounted on every tick. A test module adds what it needs on top (autouse)."""
    settings.MERIDIAN_AGENT_ENROLLMENT_TOKEN = ENROLLMENT_TOKEN
    settings.MERIDIAN_MIN_RUN_SECONDS = 0.0
    settings.MERIDIAN_ACCOUNTING_SECONDS = 0.0
    return ENROLLMENT_TOKEN
