"""The node agents of the embedded run (`./meridian run`): portal/launch.py calls
`processes(context)` and supervises what it returns.

Four local agents, one per node of the demo fleet (fleet/fixtures/demo_fleet.yaml: 2 regions x
2 clusters, 4 CPU slots each), each with its own work dir under <data dir>/agents/. They enrol
with a per-run enrollment token that this hook puts into the run's environment (so the web
server, which validates it, sees the same value). With --demo-workload, examples/demo_workload.py
submits small real training jobs of every tier as alice.

No Django here: ProcessSpec comes from portal.launch, which imports no Django either.
"""
import secrets

DEMO_NODES = (
    ("demo-east-c0-n0", "demo-east", "c0"),
    ("demo-east-c1-n0", "demo-east", "c1"),
    ("demo-west-c0-n0", "demo-west", "c0"),
    ("demo-west-c1-n0", "demo-west", "c1"),
)
DEVICES_PER_NODE = 4


def processes(context):
    from portal.launch import ProcessSpec

    env = context.env
    env.setdefault("MERIDIAN_AGENT_ENROLLMENT_TOKEN", secrets.token_urlsafe(24))
    env.setdefault("MERIDIAN_AGENT_HEARTBEAT_SECONDS", "2")
    env.setdefault("MERIDIAN_MIN_RUN_SECONDS", "30")  # the demo should show preemptions within minutes
    env.setdefault("MERIDIAN_MIN_RESIZE_INTERVAL_SECONDS", "30")  # ...and elastic jobs growing back
    env.setdefault("MERIDIAN_CHECKPOINT_STORE", str(context.data_dir / "checkpoints"))
    specs = []
    for hostname, region, cluster in DEMO_NODES:
        specs.append(ProcessSpec(f"agent-{hostname}", [
            context.python, "-m", "agent.main", "--control-plane", context.url,
            "--enroll-token", env["MERIDIAN_AGENT_ENROLLMENT_TOKEN"], "--devices", f"cpu:{DEVICES_PER_NODE}",
            "--hostname", hostname, "--region", region, "--cluster", cluster,
            "--work-dir", str(context.data_dir / "agents" / hostname), "--checkpoint-every", "30",
            "--workload-root", str(context.root), "--stop-jobs-on-exit"]))
    if context.demo_workload:
        context.handled.add("demo_workload")
        specs.append(ProcessSpec("demo", [context.python, str(context.root / "examples" / "demo_workload.py"),
                                          "--control-plane", context.url]))
    return specs
