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

Three kinds of cut (named in the rank's report and the launcher's checkpoint event):

    optimizer-step       after a torch.optim step, agreed as above (both engines)
    collective-boundary  a job that has not taken an optimizer step (manual SGD,
                         ``p.data.add_(-lr * p.grad)``): the same agreement, with each all-reduce of
                         the virtual group as the "step": the flags ride on every all-reduce and all
                         ranks cut at the entry of the same all-reduce, once the one before it has
                         carried a need. Every rank runs the same collectives in the same order, so
                         all see the same sums at the same all-reduce. CRIU only: the whole process is
                         dumped, so any point every rank has reached together is a consistent cut.
    any-moment           a single-rank CRIU job without a process group: a watcher thread takes the
                         cut at once when no optimizer step ever came (or when the next step is
                         more than ANY_MOMENT_GRACE_S late); CRIU freezes the whole process wherever
                         it is. A request for a given step (at_step) or a resize waits for steps.

An engine lists the kinds it can take (Engine.cut_kinds); the framework engine takes only
optimizer-step cuts and says why it cannot cut a job without steps (Engine.no_cut_reason).
"""
import os
import pathlib
import threading
import time

from protocol.cut import CutRequest
from runtime import spool as spool_files
from runtime import vpg
from runtime.polling import PollingThread

REQUEST_WAIT_S = 60.0
OPTIMIZER_STEP = "optimizer-step"
COLLECTIVE_BOUNDARY = "collective-boundary"
ANY_MOMENT = "any-moment"
CUT_KINDS = (OPTIMIZER_STEP, COLLECTIVE_BOUNDARY, ANY_MOMENT)
ANY_MOMENT_GRACE_S = 2.0
WATCH_INTERVAL_S = 0.02


class CutBarrier:
    """A step listener; calls on_cut(request: CutRequest, step, kind) on every rank at the same
    step (or, with on_collective installed in the virtual group, the same all-reduce)."""

    def __init__(self, *, spool, on_cut, step_of=None):
        self.request_path = pathlib.Path(spool) / "request.json"
        self.on_cut = on_cut
        self.step_of = step_of or (lambda: 0)  # optimizer steps taken so far (the tracker's)
        self.handled_id = 0
        self._seen_stat = None
        self._request = None
        self._sent = None
        self._lock = threading.RLock()  # the main thread's cuts and a watcher thread's
        self.collectives = 0  # all-reduces seen before the first optimizer step

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
        with self._lock:
            self._exchange(step, OPTIMIZER_STEP)

    def on_collective(self):
        """Called by the virtual group at the entry of every all-reduce (CRIU jobs): until the
        first optimizer step, each all-reduce is a point where the ranks can agree on a cut."""
        if self.step_of() > 0:
            return  # optimizer steps drive the cut from now on (the same on every rank)
        with self._lock:
            self.collectives += 1
            self._exchange(self.step_of(), COLLECTIVE_BOUNDARY)

    def _exchange(self, step, kind):
        sent, self._sent = self._sent, None
        if sent is not None:
            sums = vpg.take_carried_flags()
            if sums is None:  # no all-reduce since the last step: exchange the flags explicitly
                sums = vpg.meta_allreduce(sent)
            need_sum, ack_sum = sums
            if need_sum:
                self._cut(need_sum, ack_sum, step, kind)
                return
        request = self._pending_request()
        due = request is not None and step + 1 >= (request.at_step or 0)
        if kind == COLLECTIVE_BOUNDARY:
            due = request is not None and request.at_step is None
        self._sent = [1 if due else 0, request.id if due else 0]
        vpg.send_flags_with_next_allreduce(self._sent)

    def drain(self):
        """Withdraws flags that no collective will carry any more (the script has ended)."""
        with self._lock:
            self._sent = None
            vpg.take_carried_flags()

    def take_now(self, kind, *, due) -> bool:
        """Called by a watcher thread: when a request is pending and due(request) says so, takes
        the cut here and now (on_cut(request, step, kind)); returns True if it did."""
        with self._lock:
            request = self._pending_request()
            if request is None or not due(request):
                return False
            self.handled_id = request.id
            self.on_cut(request, self.step_of(), kind)
            return True

    def pending(self) -> CutRequest | None:
        with self._lock:
            return self._pending_request()

    def _cut(self, need_sum, ack_sum, step, kind=OPTIMIZER_STEP):
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
        self.on_cut(request, step, kind)


class RequestWatch(PollingThread):
    """A daemon thread of the rank that looks at the cut requests between steps.

    `any_moment`: take a checkpoint or stop request at once (a single-rank CRIU job without a
    process group) when no optimizer step was ever taken, or when no step took it within
    ANY_MOMENT_GRACE_S. `no_cut_reason`: for an engine that can only cut at optimizer steps, a
    callable returning why a job without any step cannot be cut (or None); a pending request is
    then refused at once with that reason (report_error(request, reason)) instead of timing out."""

    def __init__(self, barrier, *, any_moment, no_cut_reason=None, report_error=None,
                 interval_s=WATCH_INTERVAL_S, grace_s=ANY_MOMENT_GRACE_S):
        self.barrier = barrier
        self.any_moment = any_moment
        self.no_cut_reason = no_cut_reason
        self.report_error = report_error
        self.interval_s = interval_s
        self.grace_s = grace_s
        self._first_seen: dict[int, float] = {}
        self.any_moment_now = lambda: True  # rechecked at each request (a group may appear)

    thread_name = "meridian-cut-watch"

    def check(self):
        request = self.barrier.pending()
        if request is None or request.action not in ("checkpoint", "stop") or request.at_step is not None:
            return
        seen = self._first_seen.setdefault(request.id, time.monotonic())
        no_steps = self.barrier.step_of() == 0
        if self.any_moment and self.any_moment_now():
            late = time.monotonic() - seen >= self.grace_s
            self.barrier.take_now(ANY_MOMENT, due=lambda r: r.id == request.id and (no_steps or late))
            return
        if no_steps and self.no_cut_reason is not None and self.report_error is not None:
            reason = self.no_cut_reason()
            if reason:
                with self.barrier._lock:
                    still = self.barrier.pending()
                    if still is not None and still.id == request.id:
                        self.barrier.handled_id = request.id
                        self.report_error(request, self.barrier.step_of(), reason)


def watch_between_steps(barrier, *, engine, runtime, world_size):
    """Sets up the cuts a rank can take between optimizer steps under `engine` (its cut_kinds):
    the virtual group's collective-boundary hook, and a RequestWatch thread for any-moment cuts
    (one rank, no process group) or for the engine's refusal of a job without steps."""
    kinds = getattr(engine, "cut_kinds", (OPTIMIZER_STEP,))
    if COLLECTIVE_BOUNDARY in kinds:
        vpg.set_collective_hook(barrier.on_collective)
    any_moment = ANY_MOMENT in kinds and world_size == 1

    def any_moment_now():
        # No group means no socket for a thread to close under the script's feet.
        return any_moment and vpg.current_group() is None

    def refuse(request, step, reason):
        runtime.report(request, step, "error", error=reason)

    watch = RequestWatch(barrier, any_moment=any_moment,
                         no_cut_reason=lambda: engine.no_cut_reason(runtime), report_error=refuse)
    watch.any_moment_now = any_moment_now
    return watch.start()
