"""What the scheduler tests read from a plan (imported by the test modules beside it)."""
import scheduler


def decisions(snap):
    """Returns ([(decision kind, job name), ...], the plan) of one scheduler.schedule(snap)."""
    plan = scheduler.schedule(snap)
    name = snap.jobs.name
    return [(d.kind, name(d.job)) for d in plan.decisions], plan


def nodes_of(snap, devices):
    """Returns the sorted node indices holding `devices`."""
    return sorted({int(snap.accelerators.node[d]) for d in devices})
