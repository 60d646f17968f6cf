"""The agent's own logic, without Django: backoff, device specs, the hollow job model, job-dir collection."""
import random

import pytest

from agent.client import backoff_delay
from agent.devices import DeviceError, Devices, parse_devices
from agent.hollow import HollowJob, total_steps_of


def test_backoff_grows_exponentially_with_full_jitter_and_a_cap():
    rng = random.Random(3)
    delays = [[backoff_delay(attempt, base=0.5, cap=8.0, rng=rng) for _ in range(200)] for attempt in range(8)]
    for attempt, samples in enumerate(delays):
        bound = min(8.0, 0.5 * 2 ** attempt)
        assert all(0.0 <= d <= bound for d in samples)
        assert max(samples) > bound * 0.8  # jitter spreads over the whole window
    assert max(delays[7]) <= 8.0


@pytest.mark.parametrize("spec, expected", [("cpu:4", ("cpu", 4)), ("auto", ("auto", None)), ("CPU:1", ("cpu", 1))])
def test_device_specs_parse(spec, expected):
    assert parse_devices(spec) == expected


@pytest.mark.parametrize("spec", ["gpu:2", "cpu:0", "cpu:x", "cpu:65"])
def test_bad_device_specs_say_what_to_pass(spec):
    with pytest.raises(DeviceError, match="cpu:N"):
        parse_devices(spec)


def test_cpu_devices_describe_and_sample_telemetry():
    devices = Devices("cpu:3")
    assert [d["type"] for d in devices.describe()] == ["CPU"] * 3
    sample = devices.sample(busy_indices=[1])
    assert [d["index"] for d in sample["devices"]] == [0, 1, 2]
    assert sample["devices"][0]["utilization"] == 0.0 and 0.0 <= sample["utilization"] <= 1.0


def test_hollow_jobs_resume_at_their_checkpoint_and_know_their_length():
    entry = {"job_id": 3, "devices": 2, "last_checkpoint_step": 40, "args": ["--steps", "100"]}
    job = HollowJob(entry, now=0.0)
    assert job.step == 40 and job.total_steps == 100
    assert total_steps_of({"args": ["--epochs", "3"]}) is None


def test_old_job_directories_are_collected_and_attempt_numbers_never_reused(tmp_path):
    import json
    import os

    from agent.node import NodeReconciler, next_attempt

    node = NodeReconciler(tmp_path / "w")
    jobs_dir = tmp_path / "w" / "j"
    week_ago = 1_000_000.0

    def job_dir(name, *, pid, touched):
        path = jobs_dir / name
        (path / "logs").mkdir(parents=True)
        (path / "launcher.json").write_text(json.dumps({"pid": pid}))
        for entry in [path / "logs", path / "launcher.json", path]:
            os.utime(entry, (touched, touched))
        return path

    dead = job_dir("3.1", pid=2**22 + 7, touched=week_ago)          # ended long ago: collected
    recent = job_dir("3.2", pid=2**22 + 7, touched=week_ago + 9000)  # ended 30 min ago: kept
    running = job_dir("4.1", pid=os.getpid(), touched=week_ago)     # its launcher lives: kept

    assert node.collect_old_job_dirs(older_than_s=3600, now=week_ago + 3 * 3600) == [dead]

    assert not dead.exists() and recent.exists() and running.exists()
    assert next_attempt(jobs_dir, 3) == 3 and next_attempt(jobs_dir, 4) == 2 and next_attempt(jobs_dir, 5) == 1
