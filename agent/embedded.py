"""The node agents of the embedded run (`./meridian run`): portal/launch.py asks for the
environment defaults and the processes here, and supervises them.

Four local agents, one per node of the demo fleet (fleet/fixtures/demo_fleet.yaml: 2 regions x
2 clusters, 4 CPU slots each), each with its own work dir under <data dir>/agents/. They enrol
with a per-run enrollment token that the run's environment carries (so the web server, which
validates it, sees the same value). With a demo workload, examples/demo_workload.py submits
small real training jobs of every tier as alice.

No Django and no portal here (the agent never imports the control plane): the launcher turns
these plain (name, argv) pairs into its own process specs.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

DEMO_NODES = (
    ("demo-east-c0-n0", "demo-east", "c0"),
    ("demo-east-c1-n0", "demo-east", "c1"),
    ("demo-west-c0-n0", "demo-west", "c0"),
    ("demo-west-c1-n0", "demo-west", "c1"),
)
DEVICES_PER_NODE = 4


@dataclass(frozen=True)
class EmbeddedProcess:
    """One process of the embedded run: a name for its output prefix, its command line and what
    it adds to the run's environment (tokens go there, never on a command line)."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def embedded_env_defaults(*, data_dir: Path) -> dict[str, str]:
    """Returns the environment the embedded run needs unless the caller set it: a fresh
    enrollment token, a fast heartbeat, short policy times and the checkpoint store."""
    return {
        "MERIDIAN_AGENT_ENROLLMENT_TOKEN": secrets.token_urlsafe(24),
        "MERIDIAN_AGENT_HEARTBEAT_SECONDS": "2",
        "MERIDIAN_MIN_RUN_SECONDS": "30",  # the demo should show preemptions within minutes
        "MERIDIAN_MIN_RESIZE_INTERVAL_SECONDS": "30",  # ...and elastic jobs growing back
        "MERIDIAN_CHECKPOINT_STORE": str(data_dir / "checkpoints"),
    }


def embedded_processes(*, python: str, url: str, root: Path, data_dir: Path, enrollment_token: str,
                       demo_workload: int | bool | None) -> list[EmbeddedProcess]:
    """Returns the demo fleet's agents (and the demo workload when asked: None/False no, 0/True a
    stream without end, N > 0 a stream of N jobs) for control plane `url`. All agents share one
    workspace root: a job's workspace path is the same on every node (a CRIU restore needs it)."""
    processes = [
        EmbeddedProcess(f"agent-{hostname}", [
            python, "-m", "agent.main", "--control-plane", url,
            "--devices", f"cpu:{DEVICES_PER_NODE}",
            "--hostname", hostname, "--region", region, "--cluster", cluster,
            "--work-dir", str(data_dir / "agents" / hostname), "--checkpoint-every", "30",
            "--workload-root", str(root), "--workspace-root", str(data_dir / "workspaces"), "--stop-jobs-on-exit"],
            env={"MERIDIAN_AGENT_ENROLL_TOKEN": enrollment_token})
        for hostname, region, cluster in DEMO_NODES
    ]
    if demo_workload is not None and demo_workload is not False:
        bound = [] if demo_workload is True or not demo_workload else ["--jobs", str(int(demo_workload))]
        processes.append(EmbeddedProcess("demo", [python, str(root / "examples" / "demo_workload.py"),
                                                  "--control-plane", url, *bound]))
    return processes
