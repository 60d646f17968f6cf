"""Fixtures for the sandbox tests: real agents (NodeReconciler) launching real jobs as job uids.
The machine is made ready for job uids once (tests/job_uids.py); without root there is no sandbox:
the tests that need one skip, saying why (the unconfined path is tested by the rest of the suite).
"""
import os
import pathlib
import tempfile

import pytest
from job_uids import reach_for_job_uids


@pytest.fixture(scope="session", autouse=True)
def _interpreter_reachable():
    reach_for_job_uids()


@pytest.fixture
def node_root():
    """A folder job uids can pass through (tempfile's are 0700), removed afterwards. Under the node's
    /tmp, which a sandboxed job's own /tmp hides: the paths its ranks need are bound back
    (runtime/private_dirs.py), and these tests show that they are."""
    with tempfile.TemporaryDirectory(prefix="sbx-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o711)
        yield pathlib.Path(tmp)


@pytest.fixture
def node_root_outside_tmp():
    """node_root, but outside /tmp (in /var/tmp): what a job sees there is guarded by modes alone,
    not hidden by its private /tmp."""
    with tempfile.TemporaryDirectory(prefix="sbx-", dir="/var/tmp") as tmp:
        os.chmod(tmp, 0o711)
        yield pathlib.Path(tmp)
