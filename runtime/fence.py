"""A launcher that fences itself when its node agent has heard nothing from the control plane for
longer than the lost-node limit: the control plane has marked the node lost and restarted the job
elsewhere, so this copy must not run on beside the new one.

The agent fences its own jobs then (agent/main.py, watch_fence). That needs a live agent: a frozen
one (SIGSTOP, a stuck kernel call, a paused VM) cannot, and its jobs' ranks would keep running -
a second live copy of the job, found by the chaos soak (bench/chaos_soak.py). So the agent also
writes the instant it would fence at to a file (CLOCK_MONOTONIC, the same clock in every process of
the host); every launcher of the node reads it about once a second and, FENCE_GRACE_S past it,
writes FENCED_FILE into its job folder and ends its ranks (EXIT_FENCED). The agent, when it runs
again, forgets such a copy as it forgets one it fenced itself (never reported as failed), and
launches the job anew if the control plane still wants it here.

    deadline_write(path, deadline)   the agent, after each beat the control plane answered
    fence_due(path) -> str | None    the launcher: why it must fence itself now, or None
"""
from __future__ import annotations

import os
import pathlib
import time

FENCE_FILE = "fence-deadline"  # in the agent's work folder
FENCED_FILE = "fenced"  # in a job's folder: why its copy was fenced (by the agent or its launcher)
FENCE_GRACE_S = 2.0  # after the agent's own deadline: a live agent fences first, and says so


def deadline_write(path: str | os.PathLike, deadline: float) -> None:
    """Writes `deadline` (time.monotonic() seconds) to `path`, atomically."""
    path = pathlib.Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(f"{deadline:.3f}\n")
    os.replace(temporary, path)


def fence_due(path: str | os.PathLike, *, now: float | None = None, grace: float = FENCE_GRACE_S) -> str | None:
    """Returns why the copy must fence itself now, or None (no deadline written yet: the agent has
    not heard from the control plane since it started, and fences nothing either)."""
    try:
        deadline = float(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return None
    now = time.monotonic() if now is None else now
    if now <= deadline + grace:
        return None
    return (f"self-fenced: this node's agent has had no heartbeat answered for {now - deadline:.0f} s past the "
            f"lost-node limit (it is frozen or gone); the control plane restarts the job elsewhere from its "
            f"last checkpoint")
