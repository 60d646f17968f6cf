"""The cgroup v2 half of the sandbox (runtime/sandbox.py JobCgroup), on a real cgroup2 hierarchy:
a job's processes joined, listed and killed as a whole with `cgroup.kill` (a tree that keeps
forking included), and the folder removed once empty.

The machines this project is tested on run the hybrid layout (cpuset, memory and the freezer bound
to cgroup v1; a cgroup2 hierarchy without them at /sys/fs/cgroup/unified), so the cpuset and memory
limit of v2 can only be checked where a cgroup2 hierarchy offers those controllers: that test says
so when it skips. The kill, the membership and the removal do not need any controller."""
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from runtime.sandbox import V2_CONTROLLERS, JobCgroup

FORKER = """
import os, time
while True:  # a tree that keeps growing: a kill must catch the children forked meanwhile
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
    time.sleep(0.02)
"""


def _cgroup2_mounts():
    with open("/proc/self/mounts") as handle:
        return [line.split()[1] for line in handle if line.split()[2:3] == ["cgroup2"]]


@pytest.fixture
def v2_folder():
    if os.geteuid() != 0:
        pytest.skip("making a cgroup needs root")
    mounts = _cgroup2_mounts()
    if not mounts:
        pytest.skip("no cgroup2 hierarchy is mounted on this machine")
    folder = Path(mounts[0]) / f"meridian-test-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir()
    except OSError as exc:
        pytest.skip(f"no cgroup can be made under {mounts[0]}: {exc}")
    yield folder
    for child in sorted(folder.glob("**/"), key=lambda p: -len(p.parts)):
        try:
            child.rmdir()
        except OSError:
            pass


def _descendants(pid):
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as handle:
                children = [int(c) for c in handle.read().split()]
        except OSError:
            continue
        found.update(children)
        todo.extend(children)
    return found


def test_a_job_tree_that_keeps_forking_is_joined_listed_and_killed_as_a_whole(v2_folder):
    cgroup = JobCgroup("v2", [str(v2_folder / "job")])
    (v2_folder / "job").mkdir()
    assert (v2_folder / "job" / "cgroup.kill").exists(), "this kernel's cgroup v2 has no cgroup.kill"
    # The child joins before it forks anything (as a launcher joins before it starts a rank).
    process = subprocess.Popen([sys.executable, "-c", FORKER],
                               preexec_fn=lambda: cgroup.join(os.getpid()))
    try:
        deadline = time.monotonic() + 20
        while len(_descendants(process.pid)) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = {process.pid} | _descendants(process.pid)
        assert len(tree) >= 6 and tree <= cgroup.pids(), (tree, cgroup.pids())

        victims = cgroup.kill(timeout_s=20)

        assert process.pid in victims
        assert cgroup.pids() == set(), "processes survived cgroup.kill"
        assert process.wait(timeout=20) == -signal.SIGKILL
        assert cgroup.remove() and not (v2_folder / "job").exists()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_cpuset_and_the_memory_limit_where_cgroup_v2_offers_them(v2_folder):
    available = (v2_folder.parent / "cgroup.controllers").read_text().split()
    missing = [c for c in V2_CONTROLLERS if c not in available]
    if missing:
        pytest.skip(f"cgroup v2 at {v2_folder.parent} lacks {', '.join(missing)} (bound to cgroup v1 here): "
                    "the v2 cpuset and memory limit are UNTESTED on this machine")
    # The hierarchy's root delegates the controllers to the test's folder, which create() then
    # delegates on (as it does from the root to <root>/meridian on a node).
    (v2_folder.parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in V2_CONTROLLERS))
    cgroup = JobCgroup("v2", [str(v2_folder / "meridian" / "job")])
    cores = sorted(os.sched_getaffinity(0))[:1]
    cgroup.create(cores=cores, memory_bytes=256 << 20)
    assert cgroup.cores() == tuple(cores) and cgroup.memory_limit() == 256 << 20
    assert cgroup.remove()
