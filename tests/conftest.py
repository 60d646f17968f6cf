"""The cast (as in STYLE.md), shared by every Django test and by `manage.py demo_seed`:

  alice    submits jobs for team A (member)
  bob      is on team A too (member): sees and cancels A's jobs, approves nothing
  charlie  is on team B and must see nothing of team A's
  carol    is a capacity manager of teams A and B: approves or denies preemptions
  admin    is a global admin (superuser)
"""
import os
import pathlib

import pytest

from jobs.demo_cast import DEMO_QUOTAS, cast_create


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    # PBKDF2's 1M rounds cost ~0.3 s per demo user; the tests are not about hashing.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def cast(db):
    return cast_create()


@pytest.fixture
def team_a(cast):
    return cast.team_a


@pytest.fixture
def team_b(cast):
    return cast.team_b


@pytest.fixture
def alice(cast):
    return cast.alice


@pytest.fixture
def bob(cast):
    return cast.bob


@pytest.fixture
def charlie(cast):
    return cast.charlie


@pytest.fixture
def carol(cast):
    return cast.carol


@pytest.fixture
def admin_user(cast):
    return cast.admin


@pytest.fixture
def job_spec():
    """Returns a builder of valid job specs: job_spec(world_size=8, tier="premium")."""

    def build(**overrides):
        spec = {
            "name": "resnet-tiny",
            "tier": "standard",
            "accelerator_type": "CPU",
            "world_size": 4,
            "min_devices": 2,
            "entrypoint": "train.py",
            "args": ["--epochs", "1"],
            "env": {"LR": "0.1"},
        }
        spec.update(overrides)
        return spec

    return build


@pytest.fixture
def quotas():
    return DEMO_QUOTAS


@pytest.fixture
def api_client_for():
    """Returns a builder of DRF clients authenticated as a given user."""
    from rest_framework.test import APIClient

    def make(user):
        client = APIClient()
        client.force_authenticate(user)
        return client

    return make


@pytest.fixture
def submit(job_spec):
    """Submits a job through the service: submit(team, user, **spec_overrides)."""
    from jobs.services import job_submit

    def make(team, user, **overrides):
        return job_submit(team=team, submitted_by=user, spec=job_spec(**overrides))

    return make


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """Returns a Redis URL for tests: $REDIS_URL when set (CI's real Redis, or the one
    `./meridian test` started), else a private redis-server on a unix socket for the session."""
    import os

    from portal.private_redis import PrivateRedis

    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    # tmp_path_factory paths can exceed the 107-byte socket limit; use a short one.
    import tempfile

    directory = tempfile.mkdtemp(prefix="mr-")
    with PrivateRedis(f"{directory}/redis.sock") as redis:
        yield redis.url
    import shutil

    shutil.rmtree(directory, ignore_errors=True)


# CI's second pass runs the suite again against the machine's PostgreSQL and Redis. Only tests
# that reach a database or the channel layer can tell the two apart; the rest (the pure core,
# the protocol, the runtime, the agent's units) already ran in the first pass and are left out.
# The e2e stacks use their own SQLite files whatever DATABASE_URL says, and the browser tests
# draw pages the page tests already render on PostgreSQL: both run once, in the first pass.
DATABASE_FIXTURES = {
    "db", "transactional_db", "django_db_reset_sequences", "live_server", "django_db_serialized_rollback"
}


# `./meridian test` with no arguments runs the suite in lanes, three streams at once (portal/launch.py
# test): the hosts lane holds the emulated-host tests (tests/hosts: bridges, per-host namespaces,
# agents); the ranks lane the runtime's tests (tests/runtime: launchers and rank processes, each in
# its own temporary folders, spool root and, for CRIU, PID namespaces; no agent, node, cgroup or
# control plane); the heavy lane every other test that starts rank processes, agents, namespaces,
# cgroups or a browser (they share the node's /tmp, /dev/shm and cgroups, so that lane runs its tests
# one at a time); the light lane the rest (in-process Django, the pure core, units). The streams:
# heavy; hosts; light, then ranks. Why lanes side by side: their tests mostly wait (steps that sleep,
# beats, ticks), and the emulated hosts share nothing else with the one-host tests (their own network,
# mounts and PIDs). Why the ranks lane follows the light one: the light lane needs ~170 CPU s of the
# suite's ~3,300 and ended at 11 min of a 45-min heavy lane that held the runtime's ~1,300 s (CI-like
# run, session 28, the per-file table below). Two of the runtime's files stay in the heavy lane, to
# balance the streams: with the whole folder in the ranks lane the heavy lane ended at 23 min, the
# light and ranks lanes at 35, the hosts lane at 32.
HEAVY_MARKERS = ("runtime", "e2e", "criu", "browser", "slow")
HEAVY_FOLDERS = ("e2e", "sandbox")  # whatever their markers say
HOSTS_FOLDER = "hosts"
RANKS_FOLDER = "runtime"  # whatever its tests' markers say, but for
RANKS_FILES_IN_HEAVY = ("test_preemption.py", "test_gpu_checks_dry_run.py")  # ~510 s of its ~1,570
LANES = ("heavy", "hosts", "light", "ranks")
ROOT_OF_TESTS = pathlib.Path(__file__).resolve().parent


def lane_of(item) -> str:
    """Returns "heavy", "hosts", "light" or "ranks": the lane `item` runs in (see HEAVY_MARKERS)."""
    try:
        folder = item.path.resolve().relative_to(ROOT_OF_TESTS).parts[0]
    except ValueError:
        return "heavy"  # a test outside tests/: nothing is known of it
    if folder == HOSTS_FOLDER:
        return "hosts"
    if folder == RANKS_FOLDER:
        return "heavy" if item.path.name in RANKS_FILES_IN_HEAVY else "ranks"
    if any(item.get_closest_marker(name) for name in HEAVY_MARKERS):
        return "heavy"
    return "heavy" if folder in HEAVY_FOLDERS else "light"


def pytest_addoption(parser):
    parser.addoption("--database-tests-only", action="store_true",
                     help="run only the tests that use the database (CI's PostgreSQL + Redis pass)")
    parser.addoption("--lane", choices=LANES, action="append", default=None,
                     help="run only this lane of the suite (tests/conftest.py lane_of); repeat it for several")


def pytest_collection_modifyitems(config, items):
    lanes = config.getoption("--lane")
    database_only = config.getoption("--database-tests-only")
    if not lanes and not database_only:
        return
    kept, left_out = [], []
    for item in items:
        keep = not lanes or lane_of(item) in lanes
        if keep and database_only:
            uses_database = item.get_closest_marker("django_db") is not None or \
                DATABASE_FIXTURES & set(getattr(item, "fixturenames", ()))
            runs_own_stack = any(item.get_closest_marker(name) for name in ("e2e", "browser", "runtime"))
            keep = uses_database and not runs_own_stack
        (kept if keep else left_out).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


# Seconds per test file (setup + call + teardown), printed after a run of many files: CI's log
# keeps only its tail, and the suite's time is spent file by file (fixtures, stacks, hosts). Beside
# the wall seconds, the CPU seconds the file's tests used (pytest's process and every process it
# waited for, theirs included): a file that waits (beats, ticks, sleeping steps) shows a low
# ratio and costs little beside other lanes; one near 1 or above holds a core.
SECONDS_BY_FILE: dict[str, float] = {}
CPU_BY_FILE: dict[str, float] = {}
FILES_SHOWN = 25


def _cpu_seconds() -> float:
    user, system, children_user, children_system, _ = os.times()
    return user + system + children_user + children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    started = _cpu_seconds()
    yield
    path = item.nodeid.split("::", 1)[0]
    CPU_BY_FILE[path] = CPU_BY_FILE.get(path, 0.0) + _cpu_seconds() - started


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    SECONDS_BY_FILE[path] = SECONDS_BY_FILE.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if len(SECONDS_BY_FILE) <= 5:
        return
    total = sum(SECONDS_BY_FILE.values())
    cpu_total = sum(CPU_BY_FILE.values())
    terminalreporter.section(f"slowest {FILES_SHOWN} files (of {len(SECONDS_BY_FILE)}, {total:.0f} s in tests, "
                             f"{cpu_total:.0f} CPU s)")
    terminalreporter.write_line("  wall s  share    CPU s  CPU/wall  file")
    for path, seconds in sorted(SECONDS_BY_FILE.items(), key=lambda item: -item[1])[:FILES_SHOWN]:
        cpu = CPU_BY_FILE.get(path, 0.0)
        terminalreporter.write_line(f"{seconds:8.1f} {100 * seconds / total:5.1f}% {cpu:8.1f} "
                                    f"{cpu / seconds if seconds else 0.0:8.2f}  {path}")
