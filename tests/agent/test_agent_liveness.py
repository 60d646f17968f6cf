"""When an agent leases and when it sends a full heartbeat (agent/liveness.py).

The client here records calls and answers typed messages: what is under test is the agent's
choice between the two, not HTTP (tests/fleet/test_node_lease.py drives the lease endpoint)."""
import pytest

from agent.client import ControlPlaneError
from agent.liveness import BeatPlanner, beat_once
from protocol.node import DesiredState, HeartbeatAnswer, JobReport, LeaseAnswer
from protocol.states import CopyState


class RecordingClient:
    def __init__(self, *, serial=0, lease_status=None):
        self.serial = serial
        self.lease_status = lease_status  # None: leases are answered; else the HTTP status they fail with
        self.calls = []

    def lease(self):
        self.calls.append("lease")
        if self.lease_status is not None:
            raise ControlPlaneError(f"lease/: {self.lease_status}", self.lease_status)
        return LeaseAnswer(node_id=1, desired_serial=self.serial, lease_seconds=5.0, full_heartbeat_seconds=30.0,
                           lost_after_seconds=30.0)

    def heartbeat(self):
        self.calls.append("full")
        return HeartbeatAnswer(desired=DesiredState(node_id=1))


def running(step, *, checkpoint_step=None):
    from protocol.node import CheckpointReport

    checkpoint = CheckpointReport(step=checkpoint_step, uri=f"/s/job-7/g1/ckpt-{checkpoint_step:012d}-1", bytes=1,
                                  engine="framework") if checkpoint_step is not None else None
    return (JobReport(job_id=7, state=CopyState.RUNNING, generation=1, step=step, steps_per_s=2.0, devices=1,
                      checkpoint=checkpoint),)


def beats(client, planner, reports, now, alive=None):
    return beat_once(client=client, planner=planner, reports=reports, full_heartbeat=client.heartbeat,
                     alive=alive or (lambda sent: None), now=now)


def test_an_agent_leases_while_only_its_progress_moves_and_sends_telemetry_every_full_period():
    client, planner = RecordingClient(), BeatPlanner()
    seen = []
    for second in range(0, 65, 5):
        beats(client, planner, running(step=second * 10), now=float(second), alive=seen.append)
    # first beat full; then a lease that learns the serial (and syncs once); then leases, with a
    # full heartbeat every 30 s
    assert client.calls[:4] == ["full", "lease", "full", "lease"]
    full_at = [0.0, 5.0, 35.0]  # 30 s after the last full heartbeat (at 5 s), without a lease
    assert client.calls.count("full") == len(full_at) and planner.counts["leases"] == 11
    assert seen == sorted([float(s) for s in range(0, 65, 5)] + [5.0])  # every beat counts as alive
    assert planner.full_heartbeat_seconds == 30.0


def test_a_changed_report_or_a_changed_serial_makes_the_next_beat_a_full_heartbeat():
    client, planner = RecordingClient(), BeatPlanner()
    beats(client, planner, running(step=1), now=0.0)
    beats(client, planner, running(step=2), now=5.0)  # lease, serial learnt: full
    client.calls.clear()

    assert beats(client, planner, running(step=3), now=10.0) is None
    assert beats(client, planner, running(step=4, checkpoint_step=4), now=15.0) is not None  # a new checkpoint
    assert client.calls == ["lease", "full"]

    client.calls.clear()
    client.serial = 9  # the control plane changed this node's desired state
    assert beats(client, planner, running(step=5, checkpoint_step=4), now=20.0) is not None
    assert beats(client, planner, running(step=6, checkpoint_step=4), now=25.0) is None
    assert client.calls == ["lease", "full", "lease"]


@pytest.mark.parametrize("status, leases_after", [(404, 0), (503, 1)], ids=["no-endpoint", "store-down"])
def test_a_failed_lease_falls_back_to_a_full_heartbeat(status, leases_after):
    client, planner = RecordingClient(lease_status=status), BeatPlanner()
    beats(client, planner, (), now=0.0)
    client.calls.clear()
    assert beats(client, planner, (), now=5.0) is not None
    assert client.calls == ["lease", "full"]
    client.calls.clear()
    beats(client, planner, (), now=10.0)
    # an older control plane (404) is not asked again; a store that was down (503) is
    assert client.calls.count("lease") == leases_after and client.calls[-1] == "full"


def test_an_agent_acts_on_its_desired_state_at_every_beat_a_lease_included(tmp_path):
    """Reconciling is level-triggered (periodic checkpoints, relaunches happen there): a beat that
    only leased must still drive the copies toward the desired state the agent holds."""
    import argparse
    import threading

    from agent.main import Agent

    options = argparse.Namespace(hostname="n1", work_dir=str(tmp_path), devices="cpu:1", control_plane="http://cp",
                                 engine="framework", checkpoint_every=0.0, workload_root=str(tmp_path), interval=None,
                                 keep_finished_checkpoints=False, enroll_token=None, token="t")
    agent = Agent(options, threading.Event())
    reconciled = []
    agent.reconciler.reconcile = lambda jobs: reconciled.append(tuple(jobs))
    client = RecordingClient()
    client.heartbeat = lambda *, telemetry, jobs: RecordingClient.heartbeat(client)
    agent.client = client

    for _ in range(4):
        agent.beat()

    assert client.calls == ["full", "lease", "full", "lease", "lease"]  # beat 2 learns the serial, then syncs
    assert len(reconciled) == 4


def test_the_serial_a_full_heartbeat_answers_is_the_one_its_desired_state_holds():
    """A report that changes the node's own desired state (a checkpoint) bumps its serial; the full
    heartbeat's answer names the bumped serial, so the next lease needs no second full heartbeat."""
    client, planner = RecordingClient(), BeatPlanner()
    client.heartbeat = lambda: (client.calls.append("full"),
                                HeartbeatAnswer(desired=DesiredState(node_id=1), desired_serial=client.serial))[1]
    beats(client, planner, running(step=1), now=0.0)
    client.serial = 3  # bumped by the control plane before it built that answer
    beats(client, planner, running(step=2, checkpoint_step=2), now=5.0)
    client.calls.clear()
    assert beats(client, planner, running(step=3, checkpoint_step=2), now=10.0) is None
    assert client.calls == ["lease"]
