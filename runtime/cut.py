"""The consistent cut: every rank stops after the same optimizer step when asked.

Singularity's barrier. After every optimizer step (a step listener of the tracker) each rank
contributes two numbers to a tiny meta-allreduce through the inner group:

    need  1 when this rank has seen a pending cut request whose at_step has been reached
    ack   the request id this rank acknowledges (0 when need is 0)

Since all ranks take part in the same allreduce after the same step, they all see the same
sums: if any rank needs the barrier, every rank cuts right after this step, and all agree on
the request (ack / need is the id; the launcher issues one request at a time, so a mismatch is
reported as an error rather than guessed). Integer sums are exact in any order.

Requests reach the ranks through ``<spool>/request.json``; reading it costs one stat() per step
unless it changed. A single-process job needs no allreduce: its cut is local.
"""
import os
import pathlib

from runtime import spool as spool_files
from runtime import vpg


class CutBarrier:
    """A step listener; calls on_cut(request, step) on every rank at the same step."""

    def __init__(self, *, spool, on_cut, every=1):
        self.request_path = pathlib.Path(spool) / "request.json"
        self.on_cut = on_cut
        self.every = max(1, int(every))
        self.handled_id = 0
        self._seen_stat = None
        self._request = None

    def _pending_request(self, *, force=False):
        try:
            stat = os.stat(self.request_path)
        except FileNotFoundError:
            return None
        key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if force or key != self._seen_stat:
            self._seen_stat = key
            self._request = spool_files.read_json(self.request_path)
        request = self._request
        if request is None or int(request["id"]) <= self.handled_id:
            return None
        return request

    def __call__(self, step):
        if step % self.every:
            return
        request = self._pending_request()
        need = 1 if request is not None and step >= int(request.get("at_step") or 0) else 0
        need_sum, ack_sum = vpg.meta_allreduce([need, int(request["id"]) if need else 0])
        if need_sum == 0:
            return
        if ack_sum % need_sum:
            raise RuntimeError(f"consistent cut: ranks acknowledged different requests "
                               f"(sum of ids {ack_sum} over {need_sum} ranks)")
        request_id = ack_sum // need_sum
        if request is None or int(request["id"]) != request_id:
            request = self._pending_request(force=True)
        if request is None or int(request["id"]) != request_id:
            raise RuntimeError(f"consistent cut: request {request_id} is not readable at "
                               f"{self.request_path}")
        self.handled_id = request_id
        self.on_cut(request, step)
