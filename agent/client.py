"""The agent's HTTP client for the control plane's agent API (/api/agent/), with retries.

Every call retries transient failures (connection errors, timeouts, 5xx, 429) with exponential
backoff and full jitter (delay = uniform(0, min(cap, base * 2**attempt))), so a thousand agents
coming back after an outage do not knock the control plane over in step. A 401 (unknown or
revoked token) raises TokenRejected at once: the caller re-registers; other 4xx raise
ControlPlaneError with the server's message.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import requests

from protocol import Message, ProtocolError
from protocol.logs import LogBatch, LogBatchAnswer
from protocol.node import (
    DesiredState,
    Heartbeat,
    HeartbeatAnswer,
    JobReport,
    Lease,
    LeaseAnswer,
    Registration,
    RegistrationAnswer,
    Telemetry,
)

log = logging.getLogger("agent.client")


class ControlPlaneError(RuntimeError):
    """The control plane refused a request (4xx), could not be reached within the retries, or
    answered something this agent cannot decode."""

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


class TokenRejected(ControlPlaneError):
    """401: the node token is unknown or revoked."""


def backoff_delay(attempt, *, base=0.5, cap=30.0, rng=random):
    """Returns seconds to wait before retry `attempt` (0-based): full jitter, capped."""
    return rng.uniform(0.0, min(cap, base * (2 ** attempt)))


class ControlPlaneClient:
    def __init__(self, url, *, token=None, timeout_s=30.0, retries=6, backoff_cap_s=30.0, session=None):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_cap_s = backoff_cap_s
        self.session = session or requests.Session()
        # (version, desired state) of the last desired state the control plane sent: heartbeats name
        # the version, and the control plane omits an unchanged desired state from its answer.
        self.desired_held: tuple[str, DesiredState] | None = None
        self.node_id: int | None = None  # from the registration answer; a lease names it

    def _request(self, method, path, *, json=None, auth=None, retries=None, timeout_s=None):
        url = f"{self.url}/api/agent/{path}"
        headers = {"Authorization": auth or f"Node {self.token}"}
        retries = self.retries if retries is None else retries
        last = None
        for attempt in range(retries + 1):
            try:
                response = self.session.request(method, url, json=json, headers=headers,
                                                timeout=timeout_s or self.timeout_s)
            except requests.RequestException as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code < 300:
                    return response.json()
                detail = _detail(response)
                if response.status_code == 401:
                    raise TokenRejected(f"{method} {path}: 401 {detail}", 401)
                if response.status_code < 500 and response.status_code != 429:
                    raise ControlPlaneError(f"{method} {path}: {response.status_code} {detail}", response.status_code)
                last = f"{response.status_code} {detail}"
            if attempt < retries:
                delay = backoff_delay(attempt, cap=self.backoff_cap_s)
                log.warning("%s %s failed (%s); retry %d/%d in %.1f s", method, path, last, attempt + 1, retries, delay)
                time.sleep(delay)
        raise ControlPlaneError(f"{method} {path}: gave up after {retries + 1} attempts: {last}")

    def register(self, *, enrollment_token: str, registration: Registration) -> RegistrationAnswer:
        """Registers this node; returns the answer (node id, token, heartbeat seconds) and
        remembers the token."""
        answer = _decoded(RegistrationAnswer, self._request("POST", "register/", auth=f"Enroll {enrollment_token}",
                                                            json=registration.to_dict()), "register/")
        self.token = answer.token
        self.node_id = answer.node_id
        self.desired_held = None
        return answer

    def register_again(self, *, token: str, registration: Registration) -> RegistrationAnswer:
        """Registers this (enrolled) node again with its own node token `token` (its devices may
        have changed); returns the answer (the same token) and remembers the token. A 401 raises
        TokenRejected: the token is unknown or revoked."""
        answer = _decoded(RegistrationAnswer, self._request("POST", "register/", auth=f"Node {token}",
                                                            json=registration.to_dict()), "register/")
        self.token = answer.token
        self.node_id = answer.node_id
        self.desired_held = None
        return answer

    def lease(self, *, timeout_s: float = 10.0) -> LeaseAnswer:
        """Sends one liveness lease (POST lease/), once: a failed lease is not retried here, the
        caller sends a full heartbeat instead (agent/liveness.py). Raises TokenRejected on a 401,
        ControlPlaneError on anything else that is not a LeaseAnswer (404: a control plane without
        leases; 503: its lease store is down)."""
        if self.node_id is None:
            raise ControlPlaneError("lease/: this client has not registered (no node id)")
        return _decoded(LeaseAnswer, self._request("POST", "lease/", json=Lease(node_id=self.node_id).to_dict(),
                                                   retries=0, timeout_s=timeout_s), "lease/")

    def heartbeat(self, *, telemetry: Telemetry | dict | None, jobs: Sequence[JobReport],
                  retries: int | None = None) -> HeartbeatAnswer:
        """Sends one heartbeat (telemetry: a Telemetry or its wire dict); returns the answer:
        what became of each report and the node's desired state."""
        if isinstance(telemetry, dict):
            telemetry = Telemetry.from_dict(telemetry)
        held = self.desired_held
        heartbeat = Heartbeat(telemetry=telemetry, jobs=tuple(jobs), desired_version=held[0] if held else None)
        answer = _decoded(HeartbeatAnswer, self._request("POST", "heartbeat/", json=heartbeat.to_dict(),
                                                         retries=retries), "heartbeat/")
        if answer.desired is None:
            if held is None or answer.desired_version != held[0]:
                self.desired_held = None  # the next heartbeat asks for the whole desired state
                raise ControlPlaneError("heartbeat/: the answer omits the desired state, but not the version "
                                        "this agent holds")
            return dataclasses.replace(answer, desired=held[1])
        self.desired_held = (answer.desired_version, answer.desired) if answer.desired_version else None
        return answer

    def logs(self, batch: LogBatch, *, timeout_s: float = 10.0) -> LogBatchAnswer:
        """Sends one batch of rank output (agent/logs.py), once: the shipper backs off itself and
        keeps the backlog on disk, so a slow control plane costs it no retry loop here."""
        return _decoded(LogBatchAnswer, self._request("POST", "logs/", json=batch.to_dict(), retries=0,
                                                      timeout_s=timeout_s), "logs/")

    def desired(self) -> DesiredState:
        return _decoded(DesiredState, self._request("GET", "desired/"), "desired/")


M = TypeVar("M", bound=Message)


def _decoded(message: type[M], body: Any, path: str) -> M:
    """Returns `body` decoded as `message`; a malformed answer (or a newer protocol version) is a
    ControlPlaneError naming the field: this agent cannot act on it."""
    try:
        return message.from_dict(body)
    except ProtocolError as exc:
        raise ControlPlaneError(f"{path}: the control plane's answer is not a {message.__name__}: {exc}") from None


def _detail(response):
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return str(body)[:300]
