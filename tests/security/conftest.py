"""Fixtures of the security tests: the cast (tests/conftest.py), API clients and a small fleet."""
import pytest
from rest_framework.test import APIClient


@pytest.fixture
def client_for():
    """Returns a DRF client logged in (session, as a browser is) as the given user."""

    def make(user):
        client = APIClient()
        client.force_login(user)
        return client

    return make


@pytest.fixture
def cpu_fleet(db):
    """One region, one cluster, 2 nodes of 4 CPU devices: at most 4 devices under one node."""
    from fleet.services import fleet_generate

    fleet_generate(regions=1, clusters=1, nodes=2, devices=4, accelerator_type="CPU", prefix="sec")
