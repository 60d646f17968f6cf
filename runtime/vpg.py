"""The virtual process group: the job's collectives go through here, not straight to gloo.

An unmodified script calls ``dist.init_process_group("gloo")`` over env://; `install()` makes
that call create a `VirtualProcessGroup` (a Python `dist.ProcessGroup` registered with
`Backend.register_backend`). It delegates every collective to a private inner
`ProcessGroupGloo` built on the launcher's TCPStore, which the runtime can close (no socket,
no io_uring fd left in the process: CRIU can then dump it) and rebuild on new addresses
(after a checkpoint, a restore, a move to another node).

Reductions are deterministic: each element is combined in rank order 0, 1, ..., W-1, wherever
it sits in the tensor, so results are bitwise the same for every rank -> device -> host layout
and for DDP's bucket layout, which changes when a script is re-run from a framework checkpoint.
Four transports give the same bits, so a job may switch between them at any cut:
- ranks all on one host (`localreduce`): through a shared memory area, each chunk combined by its
  owner, with a futex barrier; synchronous, and the cut's flags ride in the same area for free.
  Cheaper than gloo's own ring over loopback TCP, which is what made the overhead goal reachable.
- ranks on several hosts, a contiguous block of P >= 2 on each (`hostchain`): each host's ranks
  through their own host's area, the hosts chaining their partial sums in host order (which is
  rank order) with point-to-point gloo messages that also carry the cut's flags; on a thread of
  the group, in issue order, so it overlaps the script's computation as gloo's all-reduce would.
- folded (`fold`: a GPU job always, a CPU job with meridian-run --fold / MERIDIAN_VPG_FOLD=1):
  the chain of hostchain with one station per device, each device's ranks through their area and
  only the device's member in the exchange between devices, over a group of one member per device
  (runtime/fold.py; NCCL on GPUs, runtime/cudagroup.py, UNPROVEN ON GPU).
- otherwise (one rank per host, no usable /dev/shm): a reduce-scatter over gloo (all-to-all of W
  chunks, each combined in rank order by its owner, the flags riding in it) then an all-gather,
  asynchronous like gloo's own all-reduce: the all-gather is handed to gloo from a callback when
  the all-to-all is done, and the next collective waits until that has happened, so every rank
  hands gloo its collectives in the same order. With W = 2 there is only one way to add two
  numbers (IEEE addition is commutative), so gloo's own all-reduce runs there.
tests/runtime/test_vpg.py checks every transport with order-sensitive values, skewed timing,
pinnings, pieces and shifted positions.

Other collectives are gloo's own, started asynchronously as under plain gloo, except on a shared
device (splicing), where a rank waits for each one with its device token given away.
"""
import datetime
import gc
import os
import queue
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]  # private, not in stubs
from torch.distributed import distributed_c10d

from runtime import hostchain, localreduce, rankorder
from runtime.hostchain import HostChain
from runtime.localreduce import LocalArea

BACKEND_NAME = "meridian"
FOLD_VARIABLE = "MERIDIAN_VPG_FOLD"  # "1": fold co-located ranks on CPU too (meridian-run --fold)
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)

_state = {"group": None, "installed": False, "connection": None, "hooks": None,
          "outgoing_flags": None, "carried_flags": None, "collective_hook": None, "cuda": False}
_CPU_BACKENDS = ("gloo", "cpu:gloo", BACKEND_NAME)


def _wants_cuda(backend):
    """True when a script's init_process_group(backend) asks for the GPU path (NCCL; or None
    where CUDA is visible, as torch itself picks NCCL then), False for gloo. Raises RuntimeError,
    the same on every rank, for NCCL without a CUDA device (saying what is missing) and for any
    other backend."""
    from runtime import cudagroup
    if backend is None:
        return cudagroup.cuda_missing() is None
    requested = str(backend).lower().replace(" ", "")
    if requested in _CPU_BACKENDS:
        return False
    if requested in cudagroup.CUDA_BACKENDS:
        if cudagroup.cuda_missing() is not None:
            raise RuntimeError(cudagroup.refusal(backend))
        return True
    raise RuntimeError(f"meridian-run: backend {backend!r} is not available under meridian-run; use "
                       "'gloo' (CPU devices) or 'nccl' (CUDA devices): collectives then go through "
                       "Meridian's virtual group")


class CollectiveHooks:
    """Called around every wait for a collective; replica splicing releases its device token here.

    `device`: this rank's job-wide device number (splice.DeviceSlot has it), or None: unknown,
    which a folded group refuses (runtime/fold.py)."""

    device = None

    def shares_device(self):
        """True when other ranks run on this rank's device (they need its turn to compute)."""
        return False

    def before_collective(self):
        pass

    def after_collective(self):
        pass


def _gloo_group(store, rank, world_size, *, bind_addr, timeout):
    """A bare ProcessGroupGloo on `store` that keeps no listening socket of its own options."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_addr)]
    pg = dist.ProcessGroupGloo(store, rank, world_size, options)
    # The options keep the gloo Device, and the Device keeps a listening socket.
    del options
    return pg


def fold_forced():
    """True when $MERIDIAN_VPG_FOLD is "1" (meridian-run --fold): fold co-located ranks even on
    CPU devices over gloo, as a GPU job always does (tests, CI: runtime/fold.py)."""
    return os.environ.get(FOLD_VARIABLE, "") == "1"


class InnerGroup:
    """A real gloo group on the launcher's store; `close()` leaves no socket behind.

    fold: reduce through the folded chain (runtime/fold.py; `device` is this rank's job-wide
    device number), whose exchange between devices goes over a group of the devices' members
    made by members_group(store, index, size) (default: gloo), messages on message_device.
    Without a usable shared area the fold falls back to the unfolded transports, unless
    fold_required (an NCCL job: there is no unfolded way), which raises instead."""

    def __init__(self, *, rank, world_size, master_addr, master_port, key_prefix,
                 bind_addr="127.0.0.1", timeout=DEFAULT_TIMEOUT, device=None, fold=False,
                 members_group=None, message_device="cpu", fold_required=False):
        self.rank = rank
        self.world_size = world_size
        # The launcher hosts the store; ranks are clients only, so no rank ever listens on the
        # store port (and no libuv server with its io_uring fd lives in a rank).
        self._store = dist.TCPStore(master_addr, int(master_port), world_size, is_master=False,
                                    timeout=timeout)
        self._prefix_store = dist.PrefixStore(key_prefix, self._store)
        self.pg = _gloo_group(self._prefix_store, rank, world_size, bind_addr=bind_addr, timeout=timeout)
        self.local = self.host_chain = self.chain_thread = None
        if fold:
            def gloo_members(store, index, size):
                return _gloo_group(store, index, size, bind_addr=bind_addr, timeout=timeout)
            self.host_chain = HostChain.open_per_device(
                self.pg, self._prefix_store, rank=rank, world_size=world_size,
                timeout_s=timeout.total_seconds(), device=device,
                members_group=members_group or gloo_members, message_device=message_device)
            if self.host_chain is None and fold_required:
                raise RuntimeError("meridian virtual group: a GPU job folds its co-located ranks "
                                   "through a shared-memory area, and this host has none usable "
                                   f"({localreduce.shm_directory()}, or {localreduce.ENABLE_VARIABLE}=0)")
            if self.host_chain is not None and rank == 0:
                plan = self.host_chain.plan
                sys.stderr.write(f"meridian virtual group: folded {world_size} ranks onto {plan.devices} "
                                 f"device(s), one communicator member each (ranks {list(plan.members)})\n")
                sys.stderr.flush()
        # Ranks all on one host reduce through shared memory instead of loopback TCP; ranks on
        # several hosts through each host's shared memory and a chain between the hosts.
        if self.host_chain is None:
            self.local = LocalArea.open(self.pg, self._prefix_store, rank=rank,
                                        world_size=world_size, timeout_s=timeout.total_seconds())
        if self.local is None and self.host_chain is None:
            self.host_chain = HostChain.open(self.pg, self._prefix_store, rank=rank,
                                             world_size=world_size, timeout_s=timeout.total_seconds())
        if self.host_chain is not None:
            self.chain_thread = _OrderedThread(f"meridian-chain-{rank}")

    @property
    def shared_reduction(self):
        """The rank-order all-reduce through shared memory this group has (the one-host area, or
        the chain across hosts), or None: the rank-order reduction runs over gloo."""
        return self.local or self.host_chain

    def close(self):
        if self.local is not None:
            self.local.close()
            self.local = None
        if self.chain_thread is not None:
            self.chain_thread.stop()  # idle: the virtual group waited for everything it ran
            self.chain_thread = None
        if self.host_chain is not None:
            self.host_chain.close()
            self.host_chain = None
        pg, self.pg = self.pg, None
        self._prefix_store = None
        self._store = None
        if pg is not None:
            _await_sole_reference(pg)
        del pg  # destroyed here, on this thread
        gc.collect()


class _OrderedThread:
    """A thread that runs submitted functions one after another, in the order submitted; each
    submit returns a torch Future of the function's result (or its exception)."""

    def __init__(self, name):
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn):
        future = torch.futures.Future()
        self._jobs.put((fn, future))
        return future

    def _run(self):
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, future = job
            del job
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - a peer died, a timeout: the waiter gets it
                future.set_exception(exc)
            else:
                future.set_result(result)
            del fn, future

    def stop(self):
        self._jobs.put(None)
        self._thread.join()


def _await_sole_reference(pg, timeout_s=10.0):
    """Waits until the caller holds the only reference to a gloo group (at most timeout_s).

    A completion callback that captured the group (`_start_reduction`'s) is released by the gloo
    worker thread that ran it, just after it set its result; if that released the last reference,
    the group would be destroyed on its own worker thread, which joins itself and aborts the
    process ("Resource deadlock avoided": seen in 2 of 25 four-rank runs)."""
    deadline = time.monotonic() + timeout_s
    # References: the caller's variable, this function's argument, getrefcount's argument.
    while sys.getrefcount(pg) > 3 and time.monotonic() < deadline:
        time.sleep(0.001)


def open_socket_fds():
    """Returns the /proc/self/fd entries that are sockets or io_uring (CRIU cannot dump them)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:") or "io_uring" in target:
            found.append(f"{name} -> {target}")
    return found


FLAG_LINE_BYTES = hostchain.FLAG_BYTES  # the cut's flags in a collective's payload (int64 sums)
_COMMUTATIVE_IN_GLOO = rankorder.COMMUTATIVE_IN_GLOO
_RANK_ORDER_OPS = rankorder.RANK_ORDER_OPS
_reduce_in_rank_order = rankorder.reduce_in_rank_order


def _any_cuda(tensors):
    return any(tensor.is_cuda for tensor in tensors)


def _flat(tensor):
    """A 1-D contiguous tensor to reduce in place: a view of `tensor`, or a copy of it."""
    flat = tensor.detach().reshape(-1)
    return flat if tensor.is_contiguous() else flat.clone()


def _copy_back(tensor, flat):
    """Puts a reduced copy made by _flat back into its tensor (nothing to do for a view)."""
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view(tensor.shape))


class _RankOrderAllreduce:
    """All-reduces one contiguous 1-D tensor in place over gloo, each element combined in rank
    order 0, 1, ..., W-1 wherever it sits in the tensor: a reduce-scatter (all-to-all of W
    chunks, rank r combines chunk r of every rank) then an all-gather. Each rank sends and
    receives 2(W-1)/W of the tensor, as in a ring all-reduce. Used when the ranks are not all on
    one host (else localreduce's shared area does the same with no TCP). Three steps, so the
    caller decides when each is started: scatter(pg), then, once its Work is done, gather(pg),
    then, once that is done, finish().

    `flags` (at most MAX_FLAGS int64, or None): the cut's flags ride in the all-to-all, a 64-byte
    line after every chunk (bytes, never arithmetic on them as floats), so every rank receives
    every rank's flags and sums them itself (flag_sums, once gather has run): no collective of
    their own. The send buffer is then a copy of the tensor with the lines in between."""

    def __init__(self, flat, op, world_size, rank, flags=None):
        self.flat, self.op, self.world_size = flat, op, world_size
        self.base, self.extra = divmod(flat.numel(), world_size)
        self.sizes = [self.base + (1 if i < self.extra else 0) for i in range(world_size)]
        self.mine_size = self.sizes[rank]
        self.gathered = None
        self.flags, self.flag_sums = flags, None
        self.tail = 0 if flags is None else FLAG_LINE_BYTES // flat.element_size()
        self.received = torch.empty(world_size * (self.mine_size + self.tail), dtype=flat.dtype)
        self.send = flat if flags is None else self._with_flag_lines(flat, flags)

    def _with_flag_lines(self, flat, flags):
        """Returns a copy of flat with the flags' line after each destination's chunk."""
        line = torch.zeros(FLAG_LINE_BYTES // 8, dtype=torch.int64)
        line[:len(flags)] = torch.tensor(flags, dtype=torch.int64)
        send = torch.empty(flat.numel() + self.world_size * self.tail, dtype=flat.dtype)
        send_bytes, size = send.view(torch.uint8), flat.element_size()
        offset = 0
        for i, chunk in enumerate(self.sizes):
            start = offset + i * self.tail
            send[start:start + chunk].copy_(flat[offset:offset + chunk])
            send_bytes[(start + chunk) * size:(start + chunk + self.tail) * size].copy_(line.view(torch.uint8))
            offset += chunk
        return send

    def scatter(self, pg):
        # Chunk i of every rank goes to rank i (uneven chunks: no padded copy of the input).
        return pg.alltoall_base(self.received, self.send, [self.mine_size + self.tail] * self.world_size,
                                [size + self.tail for size in self.sizes], dist.AllToAllOptions())

    def gather(self, pg):
        rows = self.received.view(self.world_size, self.mine_size + self.tail)
        if self.flags is not None:
            line_start = self.mine_size * self.flat.element_size()
            lines = self.received.view(torch.uint8).view(self.world_size, -1)[:, line_start:]
            self.flag_sums = lines.contiguous().view(torch.int64).sum(0)[:len(self.flags)].tolist()
            self.send = None
        mine = _reduce_in_rank_order(list(rows[:, :self.mine_size]), self.op)
        if self.extra == 0:
            return pg._allgather_base(self.flat, mine)  # straight into the tensor
        widest = self.base + 1
        padded = torch.zeros(widest, dtype=self.flat.dtype)
        padded[:mine.numel()].copy_(mine)
        self.gathered = torch.empty(self.world_size * widest, dtype=self.flat.dtype)
        return pg._allgather_base(self.gathered, padded)

    def finish(self):
        if self.gathered is not None:
            rows = self.gathered.view(self.world_size, -1)
            offset = 0
            for i, size in enumerate(self.sizes):
                self.flat[offset:offset + size].copy_(rows[i, :size])
                offset += size


class VirtualProcessGroup(dist.ProcessGroup):
    """The group the user's script sees. Collectives go to the real gloo group underneath, which
    can be closed and rebuilt between steps; the script keeps this group throughout."""

    def __init__(self, rank, world_size, connect, hooks):
        super().__init__(rank, world_size)
        self._rank = rank
        self._world_size = world_size
        self._connect = connect
        self._hooks = hooks
        self._in_flight = []  # futures of collectives issued since the last close
        self._enqueued = []  # events: a second phase was handed to gloo (see _start_reduction)
        self.inner = None

    # -- lifecycle -------------------------------------------------------------------------
    def ensure_inner(self):
        if self.inner is None:
            # Building the group waits for every peer: give the device token away meanwhile,
            # or a rank sharing this device could never get to its own rendezvous.
            self._hooks.before_collective()
            try:
                self.inner = self._connect()
            finally:
                self._hooks.after_collective()
        return self.inner

    def close_inner(self):
        # A collective in flight keeps the old communicator (and its sockets) alive, and every
        # rank issued it: let it finish first.
        self._await_enqueued()
        for future in self._in_flight:
            self.wait(future)
        self._in_flight = []
        if self.inner is not None:
            self.inner.close()
            self.inner = None

    @property
    def folded(self):
        """True while the inner group reduces through a fold (runtime/fold.py), whose plan names
        the devices: a resize must rebuild it (runtime/rank.py refold)."""
        inner = self.inner
        return inner is not None and inner.host_chain is not None and inner.host_chain.plan is not None

    def getBackendName(self):
        return BACKEND_NAME

    def shutdown(self):
        self.close_inner()

    def abort(self):
        self.close_inner()

    # -- collectives ---------------------------------------------------------------------
    def wait(self, future):
        """Waits for a collective's future with the device token given away; returns its value."""
        if future.done():
            return future.wait()
        self._hooks.before_collective()
        try:
            return future.wait()
        finally:
            self._hooks.after_collective()

    def _await_enqueued(self):
        """Returns once every second phase started from a gloo callback is in gloo's queue.

        Every rank must hand its collectives to gloo in the same order; a rank-order
        all-reduce's all-gather is handed over from a callback when its all-to-all is done, so
        the next collective waits until that has happened (usually long since)."""
        for event in self._enqueued:
            event.wait()
        self._enqueued = []

    def _start_reduction(self, pg, reduction):
        """Starts one reduction's three steps and returns at once with its future: scatter now,
        gather from a gloo callback when the scatter is done (recorded in _enqueued, so the next
        collective waits until it is in gloo's queue), finish when the gather is done."""
        self._await_enqueued()  # the previous reduction's gather first, on every rank
        result = torch.futures.Future()
        enqueued = threading.Event()

        def finished(gather_future):
            try:
                gather_future.value()
                reduction.finish()
            except BaseException as exc:  # noqa: BLE001 - a peer died, a timeout: the waiter gets it
                result.set_exception(exc)
            else:
                result.set_result(None)

        def scattered(scatter_future):
            try:
                scatter_future.value()
                work = reduction.gather(pg)
            except BaseException as exc:  # noqa: BLE001 - any failure goes to the waiter
                enqueued.set()
                result.set_exception(exc)
                return
            enqueued.set()
            work.get_future().then(finished)

        self._enqueued.append(enqueued)
        reduction.scatter(pg).get_future().then(scattered)
        return result

    def _issue_rank_order(self, tensor, op, flags=None):
        """Starts a rank-order all-reduce of one tensor over gloo and returns a future of it at
        once (it overlaps the script's computation as gloo's own all-reduce would). `flags` ride
        in its all-to-all; their sums are then what take_carried_flags returns."""
        flat = _flat(tensor)
        reduction = _RankOrderAllreduce(flat, op, self._world_size, self._rank, flags)
        future = self._start_reduction(self.ensure_inner().pg, reduction)
        if flags is not None:
            def flag_sums(finished):
                finished.value()  # raises its failure
                return reduction.flag_sums
            _state["carried_flags"] = future.then(flag_sums)

        def done(finished):
            finished.value()  # raises its failure
            _copy_back(tensor, flat)
            return [tensor]
        result = future.then(done)
        self._in_flight = [f for f in self._in_flight if not f.done()] + [result]
        return _create_work_from_future(result)

    def _reduce_through_shared_memory(self, tensors, op, flags=None):
        """All-reduces the tensors through the group's shared reduction (one host's area, or the
        chain across hosts' areas) and returns a Work. Same bits as the gloo path. `flags` ride
        with the first tensor (see localreduce, hostchain); their sums are then what
        take_carried_flags returns.

        One host: here and now (the copies are short), a completed Work. Across hosts the chain
        waits for other hosts, so it runs on the group's chain thread, in the order the
        all-reduces were issued (the same on every rank), and the Work completes when it is done:
        DDP's backward pass goes on meanwhile, as under gloo's own all-reduce. A rank sharing its
        device waits for it here with its token given away (the thread must not hand it over)."""
        self._await_enqueued()
        inner = self.ensure_inner()
        reduction = inner.shared_reduction

        def reduce_all(hooks):
            summed, carrying = None, flags
            for tensor in tensors or [torch.empty(0)]:
                flat = _flat(tensor)
                carried = reduction.allreduce(flat, op, hooks, carrying)
                if carrying is not None:
                    summed, carrying = carried, None
                _copy_back(tensor, flat)
            return summed

        if inner.host_chain is None:
            done = torch.futures.Future()
            done.set_result(reduce_all(self._hooks))
        else:
            done = inner.chain_thread.submit(lambda: reduce_all(CollectiveHooks()))
            self._in_flight = [f for f in self._in_flight if not f.done()] + [done]
            if self._hooks.shares_device():
                self.wait(done)
        if flags is not None:
            _state["carried_flags"] = done
        return _create_work_from_future(done.then(lambda _: tensors))

    def _issue(self, start):
        """Starts a collective on the inner gloo group (start(pg) returns its gloo Work) and
        returns a Work for the script that holds only the result's future.

        The gloo Work itself is not handed out: the script or DDP may keep a Work past a cut, and
        a gloo Work keeps its communicator's sockets alive. A rank alone on its device returns
        at once (gloo runs the collective while the script computes); a rank sharing its device
        waits here with the device token given away, so the others can compute their part."""
        self._await_enqueued()
        future = start(self.ensure_inner().pg).get_future()
        self._in_flight = [f for f in self._in_flight if not f.done()] + [future]
        if self._hooks.shares_device():
            self.wait(future)
        return _create_work_from_future(future)

    def _ordered(self, op):
        """True when the reduction must be computed here in rank order rather than by gloo."""
        # With two operands IEEE addition, multiplication, min and max are commutative, so
        # gloo's ring gives the same bits whichever rank adds first. From three on, its order
        # depends on where an element sits in the tensor: DDP's buckets are laid out anew when a
        # script is re-run from a framework checkpoint, which would change the bits.
        return self._world_size > 2 or op not in _COMMUTATIVE_IN_GLOO

    def _run_here(self, fn, result):
        """Runs fn(pg) (synchronous collectives) in this thread, with the device token given away
        while it waits; returns a completed Work holding `result`."""
        self._await_enqueued()
        pg = self.ensure_inner().pg
        self._hooks.before_collective()
        try:
            fn(pg)
        finally:
            self._hooks.after_collective()
        future = torch.futures.Future()
        future.set_result(result)
        return _create_work_from_future(future)

    def allreduce(self, tensors, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        op = getattr(op, "op", op)
        if op not in _RANK_ORDER_OPS:  # refused on every rank alike, before anyone waits
            raise NotImplementedError(f"meridian virtual group: reduce op {op} is not supported")
        hook = _state["collective_hook"]
        if hook is not None:  # the collective-boundary cut (runtime/cut.py): may cut right here
            hook()
        flags = _state["outgoing_flags"]
        _state["outgoing_flags"] = None
        if self.ensure_inner().shared_reduction is not None and (flags is None
                                                                 or len(flags) <= localreduce.MAX_FLAGS):
            # The cut's flags ride with the data (in the area; across hosts, in the chain's
            # messages), at no cost.
            return self._reduce_through_shared_memory(tensors, op, flags)
        ordered = self._ordered(op)
        if flags is not None and not (ordered and tensors and len(flags) <= localreduce.MAX_FLAGS):
            # The cut's flags go with this all-reduce (decided at issue time: the same point on
            # every rank) as one more small collective that gloo runs while the script computes.
            summed = torch.tensor(flags, dtype=torch.int64)
            carried = self._issue(lambda pg: pg.allreduce([summed]))
            _state["carried_flags"] = carried.get_future().then(lambda _: summed.tolist())
            flags = None
        if not ordered:
            options = dist.AllreduceOptions()
            options.reduceOp = op
            return self._issue(lambda pg: pg.allreduce(tensors, options))
        # Otherwise the flags ride in the first tensor's all-to-all (_RankOrderAllreduce).
        if len(tensors) == 1 and not self._hooks.shares_device():
            return self._issue_rank_order(tensors[0], op, flags)
        works = [self._issue_rank_order(tensor, op, flags if index == 0 else None)
                 for index, tensor in enumerate(tensors)]
        for work in works:
            self.wait(work.get_future())
        return _create_work_from_future(torch.futures.collect_all(
            [work.get_future() for work in works]).then(lambda _: tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def _staged(self, outputs, run):
        """Runs run(pg) over gloo here and now, then copies each (host, device) pair of `outputs`
        back onto the device: a GPU job's broadcast and all-gather go through the W-rank gloo
        group with host copies of their CUDA tensors (UNPROVEN ON GPU: runtime/cudagroup.py)."""
        def copied(pg):
            run(pg).wait()
            for host, device in outputs:
                device.copy_(host)
        return self._run_here(copied, [device for _, device in outputs])

    def broadcast(self, tensors, opts):
        options = dist.BroadcastOptions()
        options.rootRank = opts.rootRank
        options.rootTensor = opts.rootTensor
        if _any_cuda(tensors):
            host = [tensor.detach().cpu() for tensor in tensors]
            return self._staged(list(zip(host, tensors)), lambda pg: pg.broadcast(host, options))
        return self._issue(lambda pg: pg.broadcast(tensors, options))

    def allgather(self, output_tensors, input_tensors, opts=None):
        if _any_cuda(input_tensors) or _any_cuda(t for ts in output_tensors for t in ts):
            host_in = [tensor.detach().cpu() for tensor in input_tensors]
            host_out = [[torch.empty_like(t, device="cpu") for t in ts] for ts in output_tensors]
            pairs = [(h, t) for hs, ts in zip(host_out, output_tensors) for h, t in zip(hs, ts)]
            return self._staged(pairs, lambda pg: pg.allgather(host_out, host_in))
        return self._issue(lambda pg: pg.allgather(output_tensors, input_tensors))

    def _allgather_base(self, output, input, opts=None):
        if output.is_cuda or input.is_cuda:
            host_in, host_out = input.detach().cpu(), torch.empty_like(output, device="cpu")
            return self._staged([(host_out, output)], lambda pg: pg._allgather_base(host_out, host_in))
        return self._issue(lambda pg: pg._allgather_base(output, input))

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        op = getattr(op, "op", op)
        if not self._ordered(op) and not _any_cuda(output_tensors):
            options = dist.ReduceScatterOptions()
            options.reduceOp = op
            return self._issue(lambda pg: pg.reduce_scatter(output_tensors, input_tensors, options))
        world_size = self._world_size

        def reduce_scatter(pg):
            # Rank r receives chunk r of every rank and combines them in rank order.
            for output, inputs in zip(output_tensors, input_tensors):
                send = torch.cat([chunk.detach().reshape(-1) for chunk in inputs]).cpu()  # gloo: host
                received = torch.empty_like(send)
                pg.alltoall_base(received, send, [], [], dist.AllToAllOptions()).wait()
                rows = list(received.view(world_size, -1))
                output.copy_(_reduce_in_rank_order(rows, op).view(output.shape))
        return self._run_here(reduce_scatter, output_tensors)

    def barrier(self, opts=None):
        return self._issue(lambda pg: pg.barrier())


def meta_allreduce(values):
    """Sums a small int64 vector over all ranks through the inner group (exact, any order).
    Returns the input unchanged when no process group was initialised (a single-process job)."""
    group = _state["group"]
    tensor = torch.tensor(values, dtype=torch.int64)
    if group is None or group._world_size == 1:
        return tensor.tolist()
    if group.ensure_inner().shared_reduction is not None:
        group.wait(group._reduce_through_shared_memory([tensor], dist.ReduceOp.SUM).get_future())
    else:
        group.wait(group._issue(lambda pg: pg.allreduce([tensor])).get_future())
    return tensor.tolist()


def send_flags_with_next_allreduce(values):
    """Attaches int64 values to this rank's next all-reduce; their sums over all ranks are then
    returned by take_carried_flags(). Every rank must call this at the same point."""
    _state["outgoing_flags"] = list(values)
    _state["carried_flags"] = None


def take_carried_flags():
    """Returns the summed flags carried by an all-reduce since send_flags_with_next_allreduce
    (waiting for it to finish), or None when no all-reduce was issued since (the flags are then
    withdrawn)."""
    carried = _state.get("carried_flags")
    _state["carried_flags"] = None
    _state["outgoing_flags"] = None
    if carried is None:
        return None
    group = _state["group"]
    return group.wait(carried) if group is not None else carried.wait()


def set_collective_hook(hook):
    """Makes hook() run at the entry of every all-reduce of the job (None: no hook): the
    collective-boundary cut of runtime/cut.py, which may close and rebuild the inner group."""
    _state["collective_hook"] = hook


def current_group():
    """Returns the job's VirtualProcessGroup, or None before init_process_group / single-process."""
    return _state["group"]


def install(*, rank, world_size, connection, hooks=None):
    """Routes gloo init_process_group calls of the user's script to the virtual group.

    connection: a callable returning (master_addr, master_port, key_prefix) for the current
    rendezvous; it is called again whenever the inner group is rebuilt.
    """
    _state["connection"] = connection
    _state["hooks"] = hooks or CollectiveHooks()
    if _state["installed"]:
        return

    def create(backend_options, pg_options=None):
        def connect():
            master_addr, master_port, key_prefix = _state["connection"]()
            fold = {}
            device = getattr(_state["hooks"], "device", None)  # the launcher's logical device
            if _state["cuda"]:  # a GPU job always folds: one NCCL member per physical GPU
                from runtime import cudagroup
                device = cudagroup.device_key()
                fold = dict(fold=True, fold_required=True, message_device=cudagroup.member_device(),
                            members_group=cudagroup.nccl_members_group(DEFAULT_TIMEOUT))
            elif fold_forced():
                fold = dict(fold=True)
            # On a job spanning hosts, gloo listens on this host's address (runtime/multihost.py).
            return InnerGroup(rank=rank, world_size=world_size, master_addr=master_addr,
                              master_port=master_port, key_prefix=key_prefix,
                              bind_addr=os.environ.get("MERIDIAN_NODE_ADDR", "127.0.0.1"),
                              device=device, **fold)
        group = VirtualProcessGroup(backend_options.group_rank, backend_options.group_size,
                                    connect, _state["hooks"])
        if _state["group"] is None:
            _state["group"] = group
        return group

    # "cuda" too, so a GPU job's CUDA tensors reach the group (UNPROVEN ON GPU: runtime/cudagroup.py).
    dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["cpu", "cuda"])
    original = distributed_c10d.init_process_group

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1,
                           rank=-1, store=None, group_name="", pg_options=None,
                           device_id=None, **kwargs):
        _state["cuda"] = _wants_cuda(backend)
        if _state["cuda"]:
            import torch.cuda
            if device_id is not None:
                torch.cuda.set_device(device_id)
        if rank not in (-1, None) and int(rank) != _expected["rank"]:
            raise RuntimeError(f"meridian-run: script asked for rank {rank}, "
                               f"launcher started rank {_expected['rank']}")
        if world_size not in (-1, None) and int(world_size) != _expected["world_size"]:
            raise RuntimeError(f"meridian-run: script asked for world size {world_size}, "
                               f"launcher started {_expected['world_size']} ranks")
        # The default group's own store is a local HashStore: it never opens a socket. All real
        # communication (and its rendezvous) lives in the inner group.
        result = original(backend=BACKEND_NAME, store=dist.HashStore(),
                          rank=_expected["rank"], world_size=_expected["world_size"],
                          timeout=timeout or DEFAULT_TIMEOUT)
        group = _state["group"]
        if group is not None:
            group.ensure_inner()
        return result

    _expected = {"rank": rank, "world_size": world_size}
    dist.init_process_group = init_process_group
    distributed_c10d.init_process_group = init_process_group
    _state["installed"] = True
