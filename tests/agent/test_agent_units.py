"""The agent's own logic, without Django: backoff, device specs, the hollow job model."""
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
