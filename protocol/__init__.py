"""Meridian's one wire protocol: the typed, versioned messages that cross a process boundary.

Django-free and torch-free (standard library only), so the control plane (`jobs`, `fleet`), the
node agent and the in-job runtime all import the same definitions:

  protocol.states   the words for job states and for what a copy of a job is doing
  protocol.node     control plane <-> agent: the heartbeat report and the desired state
  protocol.launch   launcher -> agent: the event log (events.jsonl) and progress.json
  protocol.cut      launcher <-> ranks: a cut request (request.json) and its resume files
  protocol.layout   how a job's W ranks lie on d devices (who may run on how many)

Every message is a frozen dataclass built on `Message`: `to_dict()` gives what goes on the wire
(JSON-ready, with the protocol version under "v"), `from_dict(obj)` checks a received object
field by field and raises `ProtocolError` naming the first bad field. A receiver accepts any
version up to its own (fields added later have defaults) and refuses a newer one by name.
"""
from protocol.message import PROTOCOL_VERSION, Message, ProtocolError

__all__ = ["PROTOCOL_VERSION", "Message", "ProtocolError"]
