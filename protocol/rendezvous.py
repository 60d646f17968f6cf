"""Multi-host rendezvous messages: how the launchers of one job find its leader.

`LeaderAddress` is what the leading launcher (node rank 0) publishes in the job's rendezvous
folder of the shared store (runtime/rendezvous.py): the address and run-time port of the job's
TCP store on the leader's own network address, and this launch's nonce, which the store also
holds, so a follower never joins a stale leader of an earlier attempt.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from protocol.launch import JOB_NETWORK_RANGE
from protocol.message import Message, ProtocolError, bounded

MAX_NODES = 4096


@dataclass(frozen=True, kw_only=True)
class LeaderAddress(Message):
    """<rendezvous>/<job-id>/leader.json, written once by the leading launcher."""

    job_id: str = bounded(max_length=255)
    nonce: str = bounded(max_length=64)
    addr: str = bounded(max_length=255)
    port: int = bounded(minimum=1, maximum=65535)
    nodes: int = bounded(minimum=1, maximum=MAX_NODES)
    world_size: int = bounded(minimum=1, maximum=1 << 20)


@dataclass(frozen=True, kw_only=True)
class NodeAddress(Message):
    """<rendezvous>/<job-id>/nodes/<node rank>.json, written by each launcher of a job spanning
    hosts with an isolated network (runtime/netns.py JobNetworkPart): the node address through
    which the other hosts route to this host's part. Read by launchers that route it as root, so it
    must be an IPv4 address outside the job range (a job address as a gateway would loop)."""

    job_id: str = bounded(max_length=255)
    node_rank: int = bounded(minimum=0, maximum=MAX_NODES - 1)
    addr: str = bounded(max_length=15)

    def __post_init__(self) -> None:
        try:
            address = ipaddress.IPv4Address(self.addr)
        except ValueError:
            raise ProtocolError("addr", f"{self.addr!r} is not an IPv4 address") from None
        if address in JOB_NETWORK_RANGE or address.is_multicast or address.is_unspecified:
            raise ProtocolError("addr", f"{self.addr} cannot be a node's address (job range, multicast or unspecified)")


@dataclass(frozen=True, kw_only=True)
class NodeCutReport(Message):
    """A follower's answer to a cut the leader handed out (a key in the leader's store): its
    ranks all cut after `step` (status "ok"), or why not (status "error"). With the CRIU engine
    "ok" also means this node dumped its ranks into its part of the checkpoint's staging folder,
    whose part manifest has sha256 `part_manifest_sha256` (runtime/criu_parts.py)."""

    node: int = bounded(minimum=0, maximum=MAX_NODES - 1)
    request_id: int = bounded(minimum=1)
    status: str = bounded(max_length=16)
    step: int | None = bounded(default=None, minimum=0)
    error: str | None = bounded(default=None, max_length=20000)
    part_manifest_sha256: str | None = bounded(default=None, pattern=r"[0-9a-f]{64}")
