"""Fixtures for tests on emulated hosts (tests/hosts/emulated_hosts.py)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import emulated_hosts as harness  # noqa: E402 - the folder is put on sys.path just above


@pytest.fixture
def emulated_hosts():
    """Returns start(n, control_plane=False) -> EmulatedHosts; every cluster started is torn down
    at the end of the test, passed or failed. Skips, saying why, where the harness cannot run."""
    reason = harness.skip_reason()
    if reason:
        pytest.skip(reason)
    started = []

    def start(count, **kwargs):
        cluster = harness.EmulatedHosts(count, **kwargs)
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        cluster.close()
