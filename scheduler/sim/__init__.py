"""Meridian's trace-driven simulator: replay job traces (the real Philly trace, windows of
it, synthetic planet-scale traces) on a simulated fleet under Meridian's production
scheduler core and under baselines (FIFO, Tiresias, Gandiva-like), and measure JCT,
queueing, utilization, goodput, preemptions/migrations/resizes and SLA attainment.

    python -m scheduler.sim --policies fifo,tiresias,gandiva,meridian --report out.html

`simulate(trace, fleet, policy)` is the library entry point; it returns a
`metrics.SimResult` whose `summary()` is a flat dict of numbers.

The Meridian policy here IS `scheduler.schedule`: `scheduler.sim.meridian.Meridian` builds a
`scheduler.snapshot.Snapshot` from the engine's arrays each pass and applies the returned
Plan's decisions; there is no second copy of the policy in this package.
"""
from .costs import CostModel
from .engine import Engine, SimulationError
from .fleet import Fleet
from .trace import Trace

POLICY_NAMES = ("fifo", "tiresias", "gandiva", "meridian")


def make_policy(name, **options):
    """Returns a fresh policy object by name (fifo, tiresias, gandiva, meridian)."""
    from .baselines import REGISTRY

    if name == "meridian":
        from .meridian import Meridian

        return Meridian(**options)
    if name not in REGISTRY:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    return REGISTRY[name](**options)


def simulate(trace, fleet, policy, costs=None, tick_s=60.0, seed=0, until=None):
    """Runs `trace` on `fleet` under `policy` (a name or a Policy object); returns SimResult."""
    if isinstance(policy, str):
        policy = make_policy(policy)
    return Engine(trace, fleet, policy, costs=costs, tick_s=tick_s, seed=seed, until=until).run()


__all__ = ["CostModel", "Engine", "Fleet", "SimulationError", "Trace", "POLICY_NAMES",
           "make_policy", "simulate"]
