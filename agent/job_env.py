"""What of the agent's own environment a job must never see: its credentials.

A job runs another team's code on this node. The agent's environment holds the node's token and
the enrollment token (MERIDIAN_AGENT_TOKEN, MERIDIAN_AGENT_ENROLL_TOKEN), in an embedded run the
control plane's own settings too (MERIDIAN_AGENT_ENROLLMENT_TOKEN, SECRET_KEY, DATABASE_URL, ...).
With either token a job could speak for this node (read the desired state of every job here, with
their environments, and report on them). `without_agent_secrets` is applied to the environment a
job's launcher inherits; the job's own `env` (from its submission) is added after it, so what a
member gave their job still reaches it.

This is the minimum: the job sandbox (a clean environment, its own user) is built elsewhere.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

# Removed by name prefix: everything the agent (MERIDIAN_AGENT_*) and the control plane are
# configured with, and whatever a name says is a credential.
AGENT_SECRET_PREFIXES = ("MERIDIAN_AGENT_", "DJANGO_", "CELERY_")
AGENT_SECRET_NAMES = frozenset({"SECRET_KEY", "DATABASE_URL", "REDIS_URL", "MERIDIAN_CONTROL_PLANE_TOKEN"})
CREDENTIAL_WORDS = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_?KEY|PRIVATE_?KEY", re.IGNORECASE)


def is_agent_secret(name: str) -> bool:
    """True when the environment variable `name` of the agent must not reach a job."""
    upper = name.upper()
    return (upper.startswith(AGENT_SECRET_PREFIXES) or upper in AGENT_SECRET_NAMES
            or CREDENTIAL_WORDS.search(upper) is not None)


def without_agent_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """Returns a copy of `environ` without the agent's secrets (is_agent_secret)."""
    return {name: value for name, value in environ.items() if not is_agent_secret(name)}
