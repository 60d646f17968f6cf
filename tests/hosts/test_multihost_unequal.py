"""Hosts holding unequal shares of one job (issue 16): a host runs ranks in proportion to its
devices (meridian-run --first-rank/--host-ranks: W/d ranks per device it holds). W = 6 ranks on 3
devices split 2 + 1 over two emulated hosts (ranks 0..3 and 4..5) is stopped at a cut and goes on
in another layout; the reduction is in rank order whatever the layout, so it ends torch.equal to
an uninterrupted run of all 6 ranks on one host."""
import json
import os

import pytest
from multihost_jobs import REPO, assert_equal_states, start_job, wait_job
from polling import poll
from test_multihost_cut import check_all, control, load, progress_step

from runtime import criu
from runtime.store import CheckpointStore, read_manifest

DDP_SCRIPT = os.path.join(REPO, "tests", "runtime", "scripts", "ddp_mlp.py")
ARGS = ["--epochs", "8", "--step-sleep", "0.3"]  # W = 6: 3 steps an epoch
STEPS = 24
DEVICES = ("--devices", "3")
CRIU_OK, CRIU_DETAIL = criu.check_available()

pytestmark = [pytest.mark.runtime, pytest.mark.slow]


def blocks(*shares):
    """{node: its launcher's block arguments} for hosts holding `shares` devices (2 ranks each)."""
    args, first = {}, 0
    for node, devices in enumerate(shares):
        args[node] = ("--first-rank", str(first), "--host-ranks", str(2 * devices))
        first += 2 * devices
    return args


def assert_restored_at(host, job_id, step):
    """The launcher of `job_id` on `host` restored its ranks once, from the checkpoint at `step`."""
    result = host.run(["cat", f"{host.node_dir}/jobs/{job_id}/events.jsonl"], check=False)
    restored = [event for event in map(json.loads, result.stdout.splitlines()) if event.get("event") == "restored"]
    assert len(restored) == 1 and restored[0]["step"] == step, restored


def stop_on_two_plus_one(cluster, *, engine):
    """Starts the uninterrupted run (all 6 ranks on 3 devices of mh-2, beside the job), runs the job
    on mh-0 (2 devices, ranks 0..3) + mh-1 (1 device, ranks 4..5) and stops it once it has taken a
    step (the leader's cut on both hosts, one checkpoint); returns (the reference run's handle,
    job id, the checkpoint). The cut is asked only once the ranks run: 4 ranks importing torch on
    one host under load take longer than a cut's deadline."""
    _, reference = start_job([cluster[2]], ranks=6, script=DDP_SCRIPT, args=[f"{cluster[0].store}/reference.pt",
                                                                             *ARGS], launcher_args=DEVICES)
    job_id, processes = start_job(cluster.hosts[:2], ranks=6, script=DDP_SCRIPT, engine=engine,
                                  args=[f"{cluster[0].store}/moved.pt", *ARGS],
                                  launcher_args=("--store", f"{cluster[0].store}/ckpt", *DEVICES),
                                  node_args=blocks(2, 1))
    poll("the job to take a step", lambda: progress_step(cluster[0], job_id) >= 1, timeout=300)
    answer = control(cluster[0], job_id, "stop", timeout_s=120)
    step = answer.get("answer", {}).get("step")
    assert step is not None and 1 <= step < STEPS, answer
    results = wait_job(processes, timeout=180)
    assert [code for code, _ in results] == [75, 75], results  # both hosts stopped after the checkpoint
    ref = CheckpointStore(os.path.join(cluster.store_dir, "ckpt")).latest_good()
    assert ref is not None and ref.step == step and ref.engine == engine
    return reference, job_id, ref


def resume_args(cluster):
    """The moved job's script arguments and its launchers' resume arguments."""
    return [f"{cluster[0].store}/moved.pt", *ARGS], ("--store", f"{cluster[0].store}/ckpt", "--resume", *DEVICES)


def test_a_job_on_two_plus_one_devices_stops_and_resumes_on_one_plus_two_bit_exact(emulated_hosts):
    cluster = emulated_hosts(3)
    reference, job_id, ref = stop_on_two_plus_one(cluster, engine="framework")
    assert sorted(name for name in os.listdir(ref.path) if name.startswith("rank-")) == [
        f"rank-{rank}" for rank in range(6)]  # both hosts' ranks, 4 + 2, in one checkpoint
    check_all(wait_job(reference))

    # Resumed on mh-1 (1 device: ranks 0..1) + mh-2 (2 devices: ranks 2..5): the other unequal layout.
    args, launcher_args = resume_args(cluster)
    _, processes = start_job(cluster.hosts[1:3], ranks=6, script=DDP_SCRIPT, args=args,
                             launcher_args=launcher_args, node_args=blocks(1, 2), job_id=job_id + "-b")
    check_all(wait_job(processes))
    for host, local in ((cluster[1], {"0": 0, "1": 0}), (cluster[2], {"2": 1, "3": 1, "4": 2, "5": 2})):
        assert_restored_at(host, job_id + "-b", ref.step)
        progress = json.loads(host.run(["cat", f"{host.node_dir}/jobs/{job_id}-b/progress.json"]).stdout)
        assert progress["device_map"]["ranks"] == local  # this host's block on its own devices
    assert_equal_states(load(cluster, "reference.pt"), load(cluster, "moved.pt"))


@pytest.mark.criu
@pytest.mark.skipif(not CRIU_OK, reason=f"CRIU unavailable: {CRIU_DETAIL}")
def test_a_criu_checkpoint_dumped_on_two_plus_one_is_restored_onto_one_host_bit_exact(emulated_hosts):
    cluster = emulated_hosts(3)
    reference, job_id, ref = stop_on_two_plus_one(cluster, engine="criu")
    assert sorted(os.listdir(ref.path)) == ["MANIFEST.json", "node0", "node1"]
    assert read_manifest(ref.path)["meta"]["blocks"] == [[0, 4], [4, 2]]  # each host's block, named
    for node, ranks in ((0, range(0, 4)), (1, range(4, 6))):
        assert {name for name in os.listdir(ref.path / f"node{node}") if name.startswith("rank")} == {
            f"rank{rank}" for rank in ranks}
    check_all(wait_job(reference))

    # Restored onto one host (the two parts merged), which never ran the job.
    args, launcher_args = resume_args(cluster)
    _, processes = start_job([cluster[2]], ranks=6, script=DDP_SCRIPT, engine="criu", args=args,
                             launcher_args=launcher_args, job_id=job_id + "-b")
    check_all(wait_job(processes))
    assert_restored_at(cluster[2], job_id + "-b", ref.step)
    assert_equal_states(load(cluster, "reference.pt"), load(cluster, "moved.pt"))
