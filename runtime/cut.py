"""The consistent cut: every rank stops after the same optimizer step when asked.

Singularity's barrier. After every optimizer step (a step listener of the tracker) each rank
contributes two numbers to a tiny meta-allreduce:

    need  1 when this rank has seen a pending cut request that is due at the next step
    ack   the request id this rank acknowledges (0 when need is 0)

The two numbers ride along, as extra bytes, with the first all-reduce the rank makes after
step s (DDP's first gradient bucket of step s+1), so they cost no extra round trip; if no
all-reduce happens before step s+1 ends, they are exchanged by an explicit meta-allreduce then.
Every rank issues the same collectives in the same order, so all ranks see the same sums after
step s+1: if any rank needed the barrier, every rank cuts right after step s+1, and all agree on
the request (ack / need is the id; the launcher issues one request at a time, so a mismatch is
reported as an error rather than guessed). Integer sums are exact in any order. A request with
at_step=k cuts after step k (after step 2 at the earliest), or as soon as possible when it
arrives later.

Requests reach the ranks through ``<spool>/request.json``; reading it costs one stat() per step
unless it changed. A single-process job needs no allreduce: its cut is local.
"""
import os
import pathlib
import time

from protocol.cut import CutRequest
from runtime import spool as spool_files
from runtime import vpg

REQUEST_WAIT_S = 60.0


class CutBarrier:
    """A step listener; calls on_cut(request: CutRequest, step) on every rank at the same step."""

    def __init__(self, *, spool, on_cut):
        self.request_path = pathlib.Path(spool) / "request.json"
        self.on_cut = on_cut
        self.handled_id = 0
        self._seen_stat = None
        self._request = None
        self._sent = None

    def _pending_request(self, *, force: bool = False) -> CutRequest | None:
        try:
            stat = os.stat(self.request_path)
        except FileNotFoundError:
            return None
        key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if force or key != self._seen_stat:
            self._seen_stat = key
            payload = spool_files.read_json(self.request_path)
            self._request = None if payload is None else CutRequest.from_dict(payload)
        request = self._request
        if request is None or request.id <= self.handled_id:
            return None
        return request

    def __call__(self, step):
        sent, self._sent = self._sent, None
        if sent is not None:
            sums = vpg.take_carried_flags()
            if sums is None:  # no all-reduce since the last step: exchange the flags explicitly
                sums = vpg.meta_allreduce(sent)
            need_sum, ack_sum = sums
            if need_sum:
                self._cut(need_sum, ack_sum, step)
                return
        request = self._pending_request()
        due = request is not None and step + 1 >= (request.at_step or 0)
        self._sent = [1 if due else 0, request.id if due else 0]
        vpg.send_flags_with_next_allreduce(self._sent)

    def drain(self):
        """Withdraws flags that no collective will carry any more (the script has ended)."""
        self._sent = None
        vpg.take_carried_flags()

    def _cut(self, need_sum, ack_sum, step):
        if ack_sum % need_sum:
            raise RuntimeError(f"consistent cut: ranks acknowledged different requests "
                               f"(sum of ids {ack_sum} over {need_sum} ranks)")
        request_id = ack_sum // need_sum
        request = self._pending_request()
        # On a job spanning hosts, each host's launcher writes the request into its own spool:
        # ranks elsewhere may have seen it a moment before this host's copy landed.
        deadline = time.monotonic() + REQUEST_WAIT_S
        while (request is None or request.id != request_id) and time.monotonic() < deadline:
            request = self._pending_request(force=True)
            if request is None or request.id != request_id:
                time.sleep(0.005)
        if request is None or request.id != request_id:
            raise RuntimeError(f"consistent cut: request {request_id} is not readable at "
                               f"{self.request_path}")
        self.handled_id = request_id
        self.on_cut(request, step)
