"""Proofs: an unmodified script is preempted, migrated, resized and killed, and still ends
bit-for-bit where an uninterrupted run ends (torch.equal on every parameter and optimizer
tensor). Each case runs with each engine where it applies."""
import json
import random
import shutil

import pytest
from runtime_helpers import (
    COUNTER_SCRIPT,
    DDP_ARGS,
    DDP_SCRIPT,
    SINGLE_ARGS,
    SINGLE_SCRIPT,
    Job,
    assert_same_state,
    kill_ranks,
    needs_criu,
    reference_state,
    unique_id,
)

from runtime.control import JobControlError

pytestmark = [pytest.mark.runtime, pytest.mark.slow]

ENGINES = [pytest.param("criu", marks=[pytest.mark.criu, needs_criu]), "framework"]
KINDS = {"ddp": (DDP_SCRIPT, 4, DDP_ARGS, 40), "single": (SINGLE_SCRIPT, 1, SINGLE_ARGS, 36)}
SEED = 20261129


@pytest.mark.parametrize("kind", ["ddp", "single"])
@pytest.mark.parametrize("engine", ENGINES)
def test_preempt_at_a_random_step_and_resume(engine, kind, tmp_path, jobs, reference_tmp):
    script, ranks, args, steps = KINDS[kind]
    expected = reference_state(kind, reference_tmp)
    at_step = random.Random(f"{SEED}-{engine}-{kind}").randint(3, steps - 5)
    out = tmp_path / "out.pt"
    job_id = unique_id("preempt")
    node = tmp_path / "node"
    first = Job(node, ranks=ranks, script=script, out=out, script_args=args, engine=engine,
                job_id=job_id)
    jobs.append(first)
    first.wait_ready()
    answer = first.control.stop(at_step=at_step)
    assert answer["step"] == at_step and answer["engine"] == engine
    first.finish(75)
    assert not out.exists(), "the stopped job must not have reached the end of the script"

    second = Job(node, ranks=ranks, script=script, out=out, script_args=args, engine=engine,
                 job_id=job_id, resume=True)
    jobs.append(second)
    second.finish(0)
    assert_same_state(expected, out)


@pytest.mark.parametrize("engine", ENGINES)
def test_migrate_to_another_node_directory(engine, tmp_path, jobs, reference_tmp, _spool_root):
    expected = reference_state("ddp", reference_tmp)
    out = tmp_path / "out.pt"
    job_id = unique_id("migrate")
    store = tmp_path / "shared-store"  # a shared filesystem both nodes see
    node_a, node_b = tmp_path / "node-a" / "job", tmp_path / "node-b" / "job"
    first = Job(node_a, ranks=4, script=DDP_SCRIPT, out=out, script_args=DDP_ARGS,
                engine=engine, store=store, job_id=job_id)
    jobs.append(first)
    first.wait_ready()
    stopped = first.control.stop(at_step=13)
    first.finish(75)
    # Where the checkpoint's time went: with the framework engine the ranks' writes (device -> host
    # -> staging) are part of the cut, and none of their state was on a GPU here.
    (taken,) = [event for event in map(json.loads, (node_a / "events.jsonl").read_text().splitlines())
                if event["event"] == "checkpoint"]
    if engine == "framework":
        assert 0 < taken["seconds"]["save"] <= taken["seconds"]["cut"] and taken["device_bytes"] == 0, taken
    else:
        assert taken["seconds"].get("save") is None and taken.get("device_bytes") is None, taken
    # Node A is gone: its job directory with it (its launcher removed its spool when it exited).
    # Node B's launcher has a job id of its own, as a node agent's next attempt has.
    assert not (_spool_root / job_id).exists()
    shutil.rmtree(node_a)

    second = Job(node_b, ranks=4, script=DDP_SCRIPT, out=out, script_args=DDP_ARGS,
                 engine=engine, store=store, job_id=unique_id("migrate-b"), resume=True)
    jobs.append(second)
    second.finish(0)
    assert_same_state(expected, out)
    events = (node_b / "events.jsonl").read_text()
    assert '"restored"' in events and stopped["checkpoint"] in events
    assert f'"engine": "{engine}"' in events
    # The way back, stage by stage: the framework engine's ranks read their files (store -> host)
    # and loaded them into the script's objects, all four, none of it onto a GPU; CRIU restores
    # whole processes (its restored event's seconds), with no such stage after.
    applied = [event for event in map(json.loads, events.splitlines()) if event["event"] == "applied"]
    if engine == "framework":
        (applied,) = applied
        assert applied["step"] == stopped["step"] and applied["device_bytes"] == 0, applied
        assert applied["load_s"] > 0 and applied["apply_s"] > 0, applied
    else:
        assert applied == []


@pytest.mark.parametrize("engine", ENGINES)
def test_sigkill_every_rank_restores_from_last_checkpoint(engine, tmp_path, jobs, reference_tmp):
    expected = reference_state("ddp", reference_tmp)
    out = tmp_path / "out.pt"
    job_id = unique_id("kill")
    node = tmp_path / "node"
    # A sleep per step (part of the user's script, 40 steps: 20 s; 40 s under CRIU, whose
    # checkpoint also stores each distinct page of 4 ranks' images once, which on a loaded machine
    # took long enough for the job to reach its end) leaves time to take two checkpoints and kill
    # between them; the ranks keep training while a checkpoint is committed, so the second one is
    # taken as soon as possible rather than at a fixed step.
    args = DDP_ARGS + ["--step-sleep", "1.0" if engine == "criu" else "0.5"]
    first = Job(node, ranks=4, script=DDP_SCRIPT, out=out, script_args=args, engine=engine,
                job_id=job_id)
    jobs.append(first)
    first.wait_ready()
    assert first.control.checkpoint(at_step=4)["step"] == 4
    last = first.control.checkpoint()
    assert 4 < last["step"] < 38
    progress = first.wait_step(last["step"] + 2)
    assert progress["step"] < 40
    kill_ranks(progress["rank_pids"])
    first.finish(1)
    assert not out.exists()

    second = Job(node, ranks=4, script=DDP_SCRIPT, out=out, script_args=args, engine=engine,
                 job_id=job_id, resume=True)
    jobs.append(second)
    second.finish(0)
    assert_same_state(expected, out)
    events = (node / "events.jsonl").read_text().splitlines()
    restored = [e for e in events if '"restored"' in e]
    assert len(restored) == 1 and last["checkpoint"] in restored[0]


def _cores_of(pid):
    """Returns the set of cores the main thread of pid may run on (from /proc)."""
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("Cpus_allowed_list:"):
                cores = set()
                for part in line.split(":")[1].strip().split(","):
                    low, _, high = part.partition("-")
                    cores.update(range(int(low), int(high or low) + 1))
                return cores
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


def test_shrink_4_2_1_and_grow_back_to_4_devices(tmp_path, jobs, reference_tmp):
    expected = reference_state("ddp", reference_tmp)
    out = tmp_path / "out.pt"
    job = Job(tmp_path / "node", ranks=4, script=DDP_SCRIPT, out=out,
              script_args=DDP_ARGS + ["--step-sleep", "0.1"], engine="auto", devices=4,
              job_id=unique_id("resize"))
    jobs.append(job)
    job.wait_ready()
    seen_steps = []
    for devices, at_step in ((2, 6), (1, 14), (4, 24)):
        answer = job.control.resize(devices, at_step=at_step)
        # The cut is after step at_step, or later if the job got there before the request.
        assert answer["devices"] == devices and answer["step"] >= at_step
        seen_steps.append(answer["step"])
        progress = job.control.progress()
        assert progress["devices"] == devices
        device_map = progress["device_map"]
        assert len(set(device_map["ranks"].values())) == devices
        for rank, pid in enumerate(progress["rank_pids"]):
            device = device_map["ranks"][str(rank)]
            assert _cores_of(pid) == set(device_map["devices"][str(device)]), \
                f"rank {rank} is not pinned to device {device}'s cores"
    job.finish(0)
    assert seen_steps == sorted(set(seen_steps)) and seen_steps[-1] < 40
    assert_same_state(expected, out)


def test_four_ranks_started_spliced_on_one_device_then_spread(tmp_path, jobs, reference_tmp):
    expected = reference_state("ddp", reference_tmp)
    out = tmp_path / "out.pt"
    job = Job(tmp_path / "node", ranks=4, script=DDP_SCRIPT, out=out,
              script_args=DDP_ARGS + ["--step-sleep", "0.05"], engine="framework", devices=1,
              job_id=unique_id("spliced"))
    jobs.append(job)
    job.wait_ready()
    assert len(set(job.control.progress()["device_map"]["ranks"].values())) == 1
    assert job.control.resize(2, at_step=12)["step"] >= 12
    job.finish(0)
    assert_same_state(expected, out)


def test_framework_engine_refuses_a_script_it_cannot_resume_and_the_job_goes_on(tmp_path, jobs):
    out = tmp_path / "out.pt"
    job = Job(tmp_path / "node", ranks=1, script=COUNTER_SCRIPT, out=out, engine="framework",
              job_id=unique_id("refuse"))
    jobs.append(job)
    job.wait_ready()
    with pytest.raises(JobControlError, match="DataLoader"):
        job.control.stop(at_step=5)
    job.finish(0)
    assert out.exists()
    assert not list((tmp_path / "node" / "checkpoints").glob("ckpt-*"))


@pytest.mark.criu
@needs_criu
def test_a_cut_the_ranks_reach_at_different_steps_is_refused_and_the_job_goes_on(tmp_path, jobs):
    """Ranks that share no collective per step cannot agree on one step: the stop is refused, and
    the CRIU ranks that parked for it are let go (they used to wait for a resume forever)."""
    out = tmp_path / "out.pt"
    job = Job(tmp_path / "node", ranks=2, script=COUNTER_SCRIPT, out=out, engine="criu",
              script_args=["--steps", "120", "--rank-skew", "1"], job_id=unique_id("skewed"))
    jobs.append(job)
    job.wait_ready()
    job.wait_step(10)
    with pytest.raises(JobControlError, match="different steps"):
        job.control.stop()
    assert job.control.progress()["state"] == "running"
    job.finish(0)
    assert out.exists()
    assert not list((tmp_path / "node" / "checkpoints").glob("ckpt-*"))
