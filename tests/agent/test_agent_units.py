"""The agent's own logic, without Django: backoff, device specs, the hollow job model, job-dir collection."""
import random

import pytest

from agent.client import backoff_delay
from agent.devices import DeviceError, Devices, parse_devices
from agent.hollow import HollowJob, total_steps_of
from agent.node import LocalJob
from protocol.launch import CheckpointSeconds, CheckpointTaken
from protocol.node import DesiredJob


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
    entry = DesiredJob.from_dict({"job_id": 3, "action": "run", "devices": 2, "last_checkpoint_step": 40,
                                  "args": ["--steps", "100"]})
    job = HollowJob(entry, now=0.0)
    assert job.step == 40 and job.total_steps == 100
    assert total_steps_of(DesiredJob.from_dict({"job_id": 3, "action": "run", "args": ["--epochs", "3"]})) is None


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


def desired_job(**fields):
    from protocol.node import DesiredJob

    return DesiredJob.from_dict({"job_id": 7, "action": "run", "world_size": 6, "devices": 3,
                                 "device_indices": [0, 2, 5], "entrypoint": "train.py", "args": ["--steps", "9"],
                                 "store": "/store/job-7/g1", **fields})


def test_the_launch_command_gives_the_launcher_the_device_count_and_the_node_local_indices(tmp_path):
    from agent import node as agent_node

    reconciler = agent_node.NodeReconciler(tmp_path / "w", workload_root=tmp_path)

    command = reconciler.launch_command(desired_job(), job_dir=tmp_path / "j", attempt=1, store=tmp_path / "s",
                                        resume=True)

    assert command[command.index("--devices") + 1] == "3"
    assert command[command.index("--device-indices") + 1] == "0,2,5"
    assert command[-3:] == [str(tmp_path / "train.py"), "--steps", "9"] and "--resume" in command
    # indices that do not match the count: the count alone (and a warning)
    mismatched = reconciler.launch_command(desired_job(device_indices=[0, 1]), job_dir=tmp_path / "j", attempt=1,
                                           store=tmp_path / "s", resume=False)
    assert "--device-indices" not in mismatched


def test_the_launch_command_asks_the_launcher_to_restart_a_refused_resume_only_for_a_job_that_chose_it(tmp_path):
    from agent import node as agent_node

    reconciler = agent_node.NodeReconciler(tmp_path / "w", workload_root=tmp_path)

    def launched(**fields):
        return reconciler.launch_command(desired_job(**fields), job_dir=tmp_path / "j", attempt=1,
                                         store=tmp_path / "s", resume=True)

    chose = launched(if_resume_refused="restart")
    assert chose[chose.index("--if-resume-refused") + 1] == "restart"
    assert chose.index("--if-resume-refused") < chose.index(str(tmp_path / "train.py"))  # a launcher flag
    assert "--if-resume-refused" not in launched(if_resume_refused="fail")
    assert "--if-resume-refused" not in launched()  # an older control plane's entry


def write_launch_events(job_dir, *events):
    from protocol.launch import event_line

    job_dir.mkdir(parents=True)
    (job_dir / "events.jsonl").write_text("".join(event_line(event) for event in events))


def test_a_copy_started_again_after_its_refused_resume_says_why_in_every_report(tmp_path):
    from agent.node import LocalJob
    from protocol.launch import Restored, Started

    restored = Restored(time_unix=2.0, engine="framework", step=40, checkpoint="file:///s/ckpt-40", spool="/sp",
                        seconds=0.5)
    again = Started(time_unix=3.0, engine="framework", world_size=2, devices=1,
                    reason="restarted from scratch (--if-resume-refused restart): the resume was refused: seeds differ")
    write_launch_events(tmp_path / "restarted", restored, again)
    write_launch_events(tmp_path / "resumed", restored)
    first = Started(time_unix=1.0, engine="framework", world_size=2, devices=1, reason="auto: no CRIU here")
    write_launch_events(tmp_path / "fresh", first)

    report = LocalJob(7, tmp_path / "restarted").observed()
    assert report.restarted == again.reason and report.restored_step == 40
    assert LocalJob(7, tmp_path / "resumed").observed().restarted is None
    assert LocalJob(7, tmp_path / "fresh").observed().restarted is None  # a first start is no restart


def test_a_restored_copy_says_how_once_its_ranks_put_their_state_back(tmp_path):
    from agent.node import LocalJob
    from protocol.launch import Restored, StateApplied

    framework = Restored(time_unix=2.0, engine="framework", step=40, checkpoint="file:///s/ckpt-40", spool="/sp",
                         seconds=0.5)
    applied = StateApplied(time_unix=3.0, engine="framework", step=40, load_s=0.25, apply_s=0.125,
                           device_bytes=4096)
    criu = Restored(time_unix=2.0, engine="criu", step=40, checkpoint="file:///s/ckpt-40", spool="/sp",
                    seconds=4.0, device_in=1.5)
    write_launch_events(tmp_path / "loading", framework)
    write_launch_events(tmp_path / "loaded", framework, applied)
    write_launch_events(tmp_path / "criu", criu)

    loading = LocalJob(7, tmp_path / "loading")
    assert loading.restore(live=True) is None  # a live copy says it once its ranks loaded
    assert loading.restore(live=False).load_s is None  # one that ended says what it has
    loaded = LocalJob(7, tmp_path / "loaded").observed().restore
    assert (loaded.step, loaded.engine, loaded.seconds, loaded.load_s, loaded.apply_s, loaded.device_bytes) == (
        40, "framework", 0.5, 0.25, 0.125, 4096)
    restored = LocalJob(7, tmp_path / "criu").observed().restore
    assert (restored.engine, restored.seconds, restored.device_in, restored.load_s) == ("criu", 4.0, 1.5, None)


def test_a_copy_whose_host_failed_under_it_says_so_and_one_whose_code_failed_does_not(tmp_path):
    from agent.node import LocalJob
    from protocol.launch import Failed, Started

    first = Started(time_unix=1.0, engine="framework", world_size=8, devices=4, reason="requested")
    write_launch_events(tmp_path / "host", first, Failed(time_unix=2.0, host_failure=True, error=(
        "the job failed on another host (node 1: no heartbeat answered for 10 s: fenced)")))
    write_launch_events(tmp_path / "code", first, Failed(time_unix=2.0, error="rank 3 exited with code 1"))

    host = LocalJob(7, tmp_path / "host").observed()
    assert host.state == "failed" and host.host_failure is True
    assert LocalJob(7, tmp_path / "code").observed().host_failure is False


def test_a_report_the_control_plane_would_refuse_goes_with_its_state_only(caplog):
    from agent.node import _checked
    from protocol.node import JobReport

    sound = JobReport(job_id=3, state="running", generation=1, step=5)
    assert _checked(sound) == sound
    odd = JobReport(job_id=3, state="running", generation=1, step=-5, steps_per_s=float("nan"))
    assert _checked(odd) == JobReport(job_id=3, state="running", generation=1)
    assert "malformed (step: must be at least 0" in caplog.text


def test_the_client_refuses_an_answer_it_cannot_decode():
    from agent.client import ControlPlaneClient, ControlPlaneError

    class Response:
        status_code = 200

        def __init__(self, body):
            self.body = body

        def json(self):
            return self.body

    class Session:
        def __init__(self):
            self.body = {"v": 2, "desired": {"node_id": 1}}

        def request(self, method, url, **kwargs):
            self.sent = kwargs["json"]
            return Response(self.body)

    session = Session()
    client = ControlPlaneClient("http://cp", token="t", session=session, retries=0)
    with pytest.raises(ControlPlaneError, match="protocol version 2"):
        client.heartbeat(telemetry={"utilization": 0.5}, jobs=())
    assert session.sent == {"v": 1, "telemetry": {"utilization": 0.5, "memory_used_gb": None, "devices": []},
                            "jobs": [], "desired_version": None}
    session.body = {"desired": {"node_id": 1, "jobs": [{"job_id": 4, "action": "run", "devices": 1,
                                                         "device_indices": [2]}]}, "accepted": [3]}
    answer = client.heartbeat(telemetry=None, jobs=())
    assert answer.accepted == (3,) and answer.desired.jobs[0].device_indices == (2,)


def test_an_agent_acts_on_a_typed_heartbeat_answer(tmp_path):
    import argparse
    import threading

    from agent.main import Agent
    from protocol.node import DesiredState, HeartbeatAnswer, Rejection

    options = argparse.Namespace(hostname="n1", work_dir=str(tmp_path), devices="cpu:2", control_plane="http://cp",
                                 engine="framework", checkpoint_every=0.0, workload_root=str(tmp_path), interval=None,
                                 keep_finished_checkpoints=False, enroll_token=None, token="t")
    agent = Agent(options, threading.Event())
    fenced = []
    agent.reconciler.fence = lambda job_ids=None, *, why="", remove_store=False: fenced.append(
        (set(job_ids), remove_store))
    agent.reconciler.reconcile = lambda jobs: fenced.append(("reconciled", tuple(jobs)))

    class Client:
        def heartbeat(self, *, telemetry, jobs):
            self.telemetry = telemetry
            return HeartbeatAnswer(desired=DesiredState(node_id=1, lost_after_seconds=12.0), heartbeat_seconds=2.5,
                                   rejected=(Rejection(job_id=4, fence=True), Rejection(job_id=5, cancel=True),
                                             Rejection(job_id=6, error="not yours")))

    agent.client = Client()
    agent.beat()

    assert agent.interval == 2.5 and agent.lost_after_s == 12.0
    assert fenced == [({4}, False), ({5}, True), ("reconciled", ())]
    assert len(agent.client.telemetry.devices) == 2


def test_a_checkpoint_whose_manifest_is_gone_is_left_out_of_the_report_for_the_one_before_it(tmp_path):
    """The control plane refuses a report whose checkpoint has no manifest sha256, at every beat:
    a finished copy whose newest checkpoint folder had been removed was never heard to end (the
    chaos soak). The agent reports the newest checkpoint it can still read instead."""
    def taken(step):
        folder = tmp_path / "store" / f"ckpt-{step:012d}-1"
        folder.mkdir(parents=True)
        (folder / "MANIFEST.json").write_text(f'{{"step": {step}}}')
        return CheckpointTaken(time_unix=float(step), engine="framework", step=step, checkpoint=folder.as_uri(),
                               bytes=100, action="checkpoint",
                               seconds=CheckpointSeconds(cut=0.0, dump=0.0, commit=0.0, total=0.0))

    events = [taken(10), taken(20)]
    job = LocalJob(7, tmp_path / "job")
    assert job.last_checkpoint(events).step == 20
    (tmp_path / "store" / f"ckpt-{20:012d}-1" / "MANIFEST.json").unlink()
    job = LocalJob(7, tmp_path / "job")  # nothing hashed yet

    report = job.last_checkpoint(events)

    assert report.step == 10 and report.sha256 and report.uri == events[0].checkpoint
    (tmp_path / "store" / f"ckpt-{10:012d}-1" / "MANIFEST.json").unlink()
    assert LocalJob(7, tmp_path / "job").last_checkpoint(events) is None


def test_the_report_of_a_checkpoint_carries_where_its_time_went(tmp_path):
    # What the launcher measured goes to the control plane as it was (the job's event says it).
    from protocol.node import CheckpointReport
    folder = tmp_path / "store" / "ckpt-000000000012-1"
    folder.mkdir(parents=True)
    (folder / "MANIFEST.json").write_text('{"step": 12}')
    seconds = CheckpointSeconds(cut=2.5, dump=0.0, commit=0.25, total=2.8, save=1.5)
    event = CheckpointTaken(time_unix=1.0, engine="framework", step=12, checkpoint=folder.as_uri(), bytes=4096,
                            action="checkpoint", seconds=seconds, device_bytes=1024)
    report = LocalJob(7, tmp_path / "job").last_checkpoint([event])
    assert (report.seconds, report.device_bytes) == (seconds, 1024)
    assert CheckpointReport.from_dict(report.to_dict()) == report  # and back off the wire


def _agent_for(url, tmp_path, register_wait):
    import argparse
    import threading

    from agent.main import Agent

    options = argparse.Namespace(hostname="n1", work_dir=str(tmp_path), devices="cpu:1", control_plane=url,
                                 engine="framework", checkpoint_every=0.0, workload_root=str(tmp_path), interval=None,
                                 keep_finished_checkpoints=False, enroll_token="enrol", token=None,
                                 register_wait=register_wait, region="r", cluster="c", rack="")
    return Agent(options, threading.Event())


def _control_plane_on(port, status, answer):
    """A stand-in for the control plane's registration endpoint, on `port` (HTTP, in a thread)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            server.posts += 1
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.posts = 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_an_agent_started_before_its_control_plane_registers_once_it_listens(tmp_path):
    """`./meridian run` on a loaded machine: the agents started a few seconds before the web server
    listened, gave up registering after their six quick retries, and the whole launch stopped."""
    import socket
    import threading

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agent = _agent_for(f"http://127.0.0.1:{port}", tmp_path, register_wait=120)
    servers = []
    later = threading.Timer(4.0, lambda: servers.append(_control_plane_on(
        port, 201, {"node_id": 3, "token": "node-token", "hostname": "n1", "heartbeat_seconds": 2.0})))
    later.start()
    try:
        agent.register_when_reachable()
    finally:
        later.cancel()
        for server in servers:
            server.shutdown()
    assert servers, "registered before the control plane listened?"
    assert (tmp_path / "node-token").read_text() == "node-token" and agent.interval == 2.0


@pytest.mark.parametrize("status, wait", [(403, 120), (None, 0)])
def test_an_agent_gives_up_registering_at_a_refusal_or_when_its_wait_is_over(tmp_path, status, wait):
    import socket

    from agent.client import ControlPlaneError

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = _control_plane_on(port, status, {"detail": "this hostname is enrolled"}) if status else None
    agent = _agent_for(f"http://127.0.0.1:{port}", tmp_path, register_wait=wait)
    agent.client.retries = 0
    try:
        with pytest.raises(ControlPlaneError) as raised:
            agent.register_when_reachable()
    finally:
        if server is not None:
            server.shutdown()
    assert raised.value.status == status
    if server is not None:
        assert server.posts == 1  # a refusal is not retried
