"""`./meridian test` runs the suite in four lanes, three streams at once (portal/launch.py,
tests/conftest.py lane_of): every test is in exactly one; the emulated-host tests are all in the
hosts lane, the runtime's (tests/runtime) in the ranks lane but for two files left in the heavy
lane, and the other tests that share the machine (processes, namespaces, cgroups, browsers) all in
the heavy lane; each of those runs its tests one at a time."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

FILES = [
    "tests/test_polling.py",                  # no marker, not a heavy folder: light
    "tests/runtime/test_store.py",            # the ranks lane's folder, whatever its tests' markers
    "tests/runtime/test_preemption.py",       # in that folder, but left in the heavy lane (balance)
    "tests/sandbox/test_network.py",          # a heavy folder, whatever its tests' markers
    "tests/logs/test_chunking.py",            # some tests marked runtime, the others light
    "tests/browser/test_portal_browser.py",   # marked browser
    "tests/hosts/test_harness.py",            # the emulated hosts, whatever their markers
]


def _collected(*options):
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly",
                           "-p", "no:cacheprovider", *options, *FILES],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return {line for line in done.stdout.splitlines() if "::" in line}


@pytest.mark.timeout(600)
def test_the_lanes_split_the_suite_and_keep_the_machine_sharing_tests_together():
    everything, heavy, light = _collected(), _collected("--lane", "heavy"), _collected("--lane", "light")
    hosts, ranks = _collected("--lane", "hosts"), _collected("--lane", "ranks")
    assert heavy and light and hosts and ranks
    assert heavy | light | hosts | ranks == everything
    assert sum(map(len, (heavy, light, hosts, ranks))) == len(everything)  # no test in two lanes
    assert {test for test in everything if test.startswith("tests/hosts/")} == hosts
    assert {test for test in everything if test.startswith("tests/runtime/")} == ranks | {
        test for test in heavy if test.startswith("tests/runtime/")}
    assert {test for test in everything if test.startswith("tests/runtime/test_preemption.py")} <= heavy  # balance
    assert _collected("--lane", "heavy", "--lane", "hosts") == heavy | hosts  # MERIDIAN_TEST_LANES=2
    assert {test for test in everything if test.startswith("tests/test_polling.py")} <= light
    assert {test for test in everything if test.startswith(("tests/sandbox/", "tests/browser/"))} <= heavy
    chunking = {test for test in everything if test.startswith("tests/logs/test_chunking.py")}
    assert chunking & heavy and chunking & light  # split by marker within one file
