"""What a replay charges beyond the scheduler's own costs: the start-up of a job's first
allocation, and how capacity managers answer approval requests.

Start-up (`StartupCosts`): a job's first allocation pays process start, image pull and data
loading before it makes progress (its devices are held meanwhile). The cost is per job class,
the class given by the job's size:
    single     W = 1          default 75 s = 15 s process start + 30 s image pull + 30 s data
    node       2 <= W <= 8    default 105 s = 15 + 30 + 60 (more shards to load)
    multinode  W > 8          default 165 s = 15 + 30 + 120 (data, and the rendezvous of many nodes)
These are assumptions (not measured here): a ~10 GB training image pulled at ~0.3 GB/s onto a
cold node, a dataset mount and the first batches prefetched. Later allocations (after a
preemption or a failure) pay the restore cost of `costs.CostModel` instead: the checkpoint
carries the warmed state, and the image stays cached on the node. Philly's durations are the
jobs' run times; the start-up is charged on top, for every policy alike. SLA attainment
(metrics.py) does not count the job's own start-up against the scheduler.

Approvals (`ApprovalModel`): a Preempt that needs a capacity manager's approval
(`Preempt.needs_approval`) becomes a request; after a seeded delay the request is granted or,
with probability `denial_rate`, denied. A grant lets the next pass preempt or shrink the
victim (Jobs.preemption_approved); a denial protects it (Jobs.preemption_denied). Both hold for
the victim's current run only (production: an approval decided after the job's last start),
like a request asked during a run that has since ended, which is dropped. Delays:
    never                no one answers (the old behaviour)
    fixed:S              S seconds
    exp:MEAN             exponential with that mean (default exp:900, 15 min, 10% denied: an
                         assumption, a capacity manager on call)
    lognormal:MEDIAN,SIGMA
Every draw comes from `numpy.random.default_rng([seed, 7006])` in request order.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

JOB_CLASSES = ("single", "node", "multinode")


class FidelityError(ValueError):
    """A start-up or approval setting is unusable; the message says how to write it."""


@dataclasses.dataclass(frozen=True)
class StartupCosts:
    """Seconds of start-up per job class (JOB_CLASSES) on a job's first allocation."""

    single: float = 75.0
    node: float = 105.0
    multinode: float = 165.0

    def __post_init__(self):
        for name in JOB_CLASSES:
            value = getattr(self, name)
            if not (0 <= value < math.inf):
                raise FidelityError(f"start-up of class {name} must be a finite number >= 0, got {value!r}")

    @classmethod
    def parse(cls, text):
        """Returns the costs of 'none', 'default', or 'single=S,node=S,multinode=S' (any subset,
        the others keep their defaults)."""
        text = (text or "default").strip()
        if text == "default":
            return cls()
        if text == "none":
            return cls(0.0, 0.0, 0.0)
        values = {}
        for part in text.split(","):
            name, _, value = part.partition("=")
            name = name.strip()
            if name not in JOB_CLASSES:
                raise FidelityError(f"--startup: unknown job class {name!r}; write none, default or "
                                    f"{'=S,'.join(JOB_CLASSES)}=S (seconds)")
            try:
                values[name] = float(value)
            except ValueError:
                raise FidelityError(f"--startup: {part!r} needs a number of seconds after '='") from None
        return cls(**values)

    def job_class(self, ranks):
        """Returns the class index (into JOB_CLASSES) of each job of `ranks` world size."""
        ranks = np.asarray(ranks)
        return np.where(ranks <= 1, 0, np.where(ranks <= 8, 1, 2)).astype(np.int8)

    def per_job(self, ranks):
        """Returns the start-up seconds of each job (float64)."""
        table = np.array([getattr(self, name) for name in JOB_CLASSES], dtype=np.float64)
        return table[self.job_class(ranks)]


@dataclasses.dataclass(frozen=True)
class ApprovalModel:
    """How long a capacity manager takes to answer and how often the answer is no."""

    delay: str = "exp:900"
    denial_rate: float = 0.1

    def __post_init__(self):
        self._parsed()  # refuse a bad spec when built, not mid-replay
        if not (0.0 <= self.denial_rate <= 1.0):
            raise FidelityError(f"the approval denial rate must be in [0, 1], got {self.denial_rate!r}")

    @property
    def answers(self):
        return self._parsed()[0] != "never"

    def _parsed(self):
        kind, _, args = self.delay.strip().partition(":")
        try:
            numbers = [float(x) for x in args.split(",")] if args else []
        except ValueError:
            numbers = None
        shapes = {"never": 0, "fixed": 1, "exp": 1, "lognormal": 2}
        if kind not in shapes or numbers is None or len(numbers) != shapes[kind] or \
                any(not (0 <= x < math.inf) for x in numbers):
            raise FidelityError(f"approval delay {self.delay!r}: write never, fixed:SECONDS, exp:MEAN_SECONDS "
                                "or lognormal:MEDIAN_SECONDS,SIGMA (numbers >= 0)")
        return kind, numbers

    def draw(self, rng):
        """Returns (delay seconds, denied) for one request; delay is inf when no one answers."""
        kind, numbers = self._parsed()
        if kind == "never":
            return math.inf, False
        if kind == "fixed":
            delay = numbers[0]
        elif kind == "exp":
            delay = float(rng.exponential(numbers[0])) if numbers[0] > 0 else 0.0
        else:
            delay = float(rng.lognormal(math.log(max(numbers[0], 1e-9)), numbers[1]))
        return delay, bool(rng.random() < self.denial_rate)


NEVER = ApprovalModel(delay="never", denial_rate=0.0)
