"""Fixtures for the sandbox tests: real agents (NodeReconciler) launching real jobs as job uids.

The job uids must be able to reach the Python interpreter and the runtime. On the machines this
project is tested on, Python lives under /root (mode 0700): the session fixture gives the folders
on the way o+x (traverse only, no listing) and says so. Without root there is no sandbox: the
tests that need one skip, saying why (the unconfined path is tested by the rest of the suite).
"""
import os
import pathlib
import stat
import sys
import tempfile

import pytest

from agent.sandbox import unreachable

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session", autouse=True)
def _interpreter_reachable():
    if os.geteuid() != 0:
        return
    for path in (os.path.realpath(sys.executable), ROOT):
        for entry in unreachable(path):
            folder = entry.split(" (mode")[0]
            os.chmod(folder, os.stat(folder).st_mode | stat.S_IXOTH)
            print(f"[sandbox tests] gave {folder} o+x so that job uids reach {path}", file=sys.stderr)


@pytest.fixture
def node_root():
    """A folder job uids can pass through (tempfile's are 0700), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="sbx-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o711)
        yield pathlib.Path(tmp)
