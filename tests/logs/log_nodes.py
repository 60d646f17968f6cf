"""Nodes for the log API tests: enrolled through the real registration API."""
import pytest
from rest_framework.test import APIClient

ENROLL = "enroll-secret"


@pytest.fixture(autouse=True)
def enrollment(settings):
    """Imported by a test module, it sets the enrollment token for every test there."""
    settings.MERIDIAN_AGENT_ENROLLMENT_TOKEN = ENROLL
    settings.MERIDIAN_MIN_RUN_SECONDS = 0.0


def register(hostname, *, devices=2):
    """Registers a node of `devices` CPU devices; returns the registration answer (its token)."""
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Enroll {ENROLL}")
    return client.post("/api/agent/register/", {"hostname": hostname, "region": "eu", "cluster": "c1",
                                                "devices": [{"type": "CPU"}] * devices}, format="json").json()
