"""Helpers of the sandbox tests: an agent (NodeReconciler) with a sandbox, desired entries, polling."""
import json
import pathlib

import pytest
from job_uids import sandbox_unavailable
from polling import poll

from agent.node import NodeReconciler
from agent.sandbox import NodeSandbox, SandboxPolicy

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = pathlib.Path(__file__).resolve().parent / "scripts"
PROBE = SCRIPTS / "probe.py"
UID_BASE = 1_500_000  # a range of its own, away from other tests' agents


CGROUPS_UNAVAILABLE = sandbox_unavailable()
needs_sandbox = pytest.mark.skipif(CGROUPS_UNAVAILABLE is not None,
                                   reason=f"no sandbox on this machine: {CGROUPS_UNAVAILABLE}")


def make_node(work_dir, *, node_devices=2, mode="enforce", engine="framework", node_cores=(0, 1)):
    """Returns a real agent's reconciler for `work_dir` with a sandbox of `node_devices` CPU devices
    over `node_cores`."""
    sandbox = NodeSandbox(SandboxPolicy(mode=mode, uid_base=UID_BASE), work_dir=pathlib.Path(work_dir),
                          node_devices=node_devices, node_cores=node_cores)
    return NodeReconciler(work_dir, engine=engine, checkpoint_every_s=0, workload_root=ROOT, sandbox=sandbox)


def entry(job_id, store_root, *, script=PROBE, args=(), indices=(0,), world_size=1, env=None, generation=1,
          network=None):
    """A desired "run" entry as the control plane sends it; `network` None: left out (isolated)."""
    wire = {"job_id": job_id, "action": "run", "generation": generation, "world_size": world_size,
            "devices": len(indices), "device_indices": list(indices), "entrypoint": str(script),
            "args": [str(a) for a in args], "env": env or {},
            "store": str(pathlib.Path(store_root) / f"job-{job_id}" / f"g{generation}")}
    if network is not None:
        wire["network"] = network
    return wire


def workspace(work_dir, job_id):
    """Makes job `job_id`'s workspace the way the workspace code does (<work dir>/workspaces/job-<id>)."""
    path = pathlib.Path(work_dir) / "workspaces" / f"job-{job_id}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def outcome(node, job_id):
    """Polls until job `job_id`'s copy ended; returns its report's wire dict."""
    def ended():
        reports = {r.job_id: r.to_dict() for r in node.observed()}
        report = reports.get(job_id)
        return report if report and report["state"] in ("finished", "failed", "stopped") else None
    return poll(f"job {job_id} to end", ended, timeout=180)


def probe_report(path, *, timeout=180):
    path = pathlib.Path(path)
    poll(f"{path} to be written", lambda: path.exists() and path.stat().st_size > 0, timeout=timeout)
    return json.loads(path.read_text())
