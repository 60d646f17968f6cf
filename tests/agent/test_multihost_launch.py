"""The agent's share of a job that spans hosts (issue 14 §4): the multi-node meridian-run command
line from the desired entry's span (this host's block of ranks, unequal when its hosts hold unequal
device counts), a share whose block its devices cannot run is refused by name, and a follower's
copy is never sent commands (the leader cuts every host)."""
from protocol.node import DesiredJob

SPAN = {"nodes": 2, "node_rank": 1, "first_rank": 4, "ranks": 4, "job_devices": 8, "leader": "mh-0",
        "rendezvous": "/store/job-7/g3/rendezvous"}


def desired_job(**fields):
    return DesiredJob.from_dict({"job_id": 7, "action": "run", "world_size": 8, "devices": 4, "generation": 3,
                                 "device_indices": [0, 1, 2, 3], "entrypoint": "train.py", "args": ["--steps", "9"],
                                 "store": "/store/job-7/g3", "span": SPAN, **fields})


def test_the_launch_command_of_a_hosts_share_runs_the_multi_node_launcher(tmp_path):
    from agent import node as agent_node

    reconciler = agent_node.NodeReconciler(tmp_path / "w", workload_root=tmp_path, node_addr="10.213.5.11")
    command = reconciler.launch_command(desired_job(), job_dir=tmp_path / "j", attempt=2, store=tmp_path / "s",
                                        resume=True)

    def value(flag):
        return command[command.index(flag) + 1]

    assert (value("--nodes"), value("--node-rank"), value("--node-addr"), value("--rendezvous")) == (
        "2", "1", "10.213.5.11", "/store/job-7/g3/rendezvous")
    assert value("--devices") == "8" and value("--ranks") == "8"  # the job's devices in all
    assert (value("--first-rank"), value("--host-ranks")) == ("4", "4")  # this host's block of ranks
    assert value("--job-id") == "j7-g3"  # the same on every host of the generation, whatever the attempt
    # pinned to this host's own devices (the launcher maps this host's ranks onto exactly them)
    assert value("--device-indices") == "0,1,2,3"
    other = reconciler.launch_command(desired_job(device_indices=[4, 5, 6, 7]), job_dir=tmp_path / "j", attempt=2,
                                      store=tmp_path / "s", resume=True)
    assert other[other.index("--device-indices") + 1] == "4,5,6,7"
    # one host: the single-node command, as before
    single = reconciler.launch_command(desired_job(span=None), job_dir=tmp_path / "j", attempt=2,
                                       store=tmp_path / "s", resume=False)
    assert "--nodes" not in single and single[single.index("--device-indices") + 1] == "0,1,2,3"


def test_a_hosts_share_passes_the_restart_policy_on_for_its_launcher_to_refuse_by_name(tmp_path):
    from agent import node as agent_node

    reconciler = agent_node.NodeReconciler(tmp_path / "w", workload_root=tmp_path, node_addr="10.213.5.11")
    command = reconciler.launch_command(desired_job(if_resume_refused="restart"), job_dir=tmp_path / "j", attempt=2,
                                        store=tmp_path / "s", resume=True)

    # The launcher of a job spanning hosts fails a refused resume, saying the restart is not applied
    # (tests/runtime/test_launcher_resume_refused.py); dropped here, the job's events would not say so.
    assert command[command.index("--if-resume-refused") + 1] == "restart" and "--nodes" in command


def test_a_share_whose_block_its_devices_cannot_run_is_refused_by_name(tmp_path):
    from agent.node import multihost_span_problem

    assert multihost_span_problem(desired_job()) is None
    assert multihost_span_problem(desired_job(span=None)) is None
    # W = 6 on 3 devices over 2 hosts holding 2 + 1: blocks 0..3 and 4..5 (2 ranks per device) run
    six = {**SPAN, "job_devices": 3}
    assert multihost_span_problem(desired_job(world_size=6, devices=2, device_indices=[0, 1],
                                              span={**six, "node_rank": 0, "first_rank": 0, "ranks": 4})) is None
    assert multihost_span_problem(desired_job(world_size=6, devices=1, device_indices=[3],
                                              span={**six, "first_rank": 4, "ranks": 2})) is None
    # a block that does not match this host's devices: 2 devices hold 4 ranks, not 2
    mismatch = multihost_span_problem(desired_job(world_size=6, devices=2, device_indices=[0, 1],
                                                  span={**six, "first_rank": 4, "ranks": 2}))
    assert mismatch == ("this host holds 2 of the job's 3 devices but ranks 4..5, which run on 1 of them "
                        "(2 ranks per device): its ranks are pinned to its own devices")
    # a block that splits a device between hosts, one outside the job, one that cannot divide
    split = multihost_span_problem(desired_job(world_size=6, devices=1, device_indices=[3],
                                               span={**six, "first_rank": 3, "ranks": 3}))
    assert "this host's share cannot run" in split and "not whole devices" in split
    outside = multihost_span_problem(desired_job(span={**SPAN, "first_rank": 6, "ranks": 4}))
    assert "not inside the job's ranks 0..7" in outside
    assert "cannot run" in multihost_span_problem(desired_job(world_size=7, span={**SPAN, "first_rank": 4,
                                                                                   "ranks": 3}))


def test_a_followers_copy_is_never_sent_a_command(tmp_path):
    from agent import node as agent_node

    reconciler = agent_node.NodeReconciler(tmp_path / "w", workload_root=tmp_path)
    job = agent_node.LocalJob(7, tmp_path / "j")
    job.follower = True
    reconciler._call(job, "stop")
    assert job.stop_requested and job.busy is None  # it ends with the leader's cut; no thread, no call
