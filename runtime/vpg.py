"""The virtual process group: the job's collectives go through here, not straight to gloo.

An unmodified script calls ``dist.init_process_group("gloo")`` over env://; `install()` makes
that call create a `VirtualProcessGroup` (a Python `dist.ProcessGroup` registered with
`Backend.register_backend`). It delegates every collective to a private inner
`ProcessGroupGloo` built on the launcher's TCPStore, which the runtime can close (no socket,
no io_uring fd left in the process: CRIU can then dump it) and rebuild on new addresses
(after a checkpoint, a restore, a move to another node).

Reductions are deterministic: every rank's tensor is all-gathered and summed in rank order,
so the result is bitwise the same whatever the rank -> process -> device layout (gloo's ring
all-reduce is not). This costs W x the traffic of a ring all-reduce: fine for the CPU job
sizes it serves here; a deterministic reduce-scatter is the upgrade for large W.
"""
import datetime
import gc
import os

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch._C._distributed_c10d import _create_work_from_future

BACKEND_NAME = "meridian"
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)

_state = {"group": None, "installed": False, "connection": None, "hooks": None,
          "outgoing_flags": None, "carried_flags": None, "pending_meta": None}


class CollectiveHooks:
    """Called around every collective; replica splicing releases its device token here."""

    def before_collective(self):
        pass

    def after_collective(self):
        pass


class InnerGroup:
    """A real gloo group on the launcher's store; `close()` leaves no socket behind."""

    def __init__(self, *, rank, world_size, master_addr, master_port, key_prefix,
                 bind_addr="127.0.0.1", timeout=DEFAULT_TIMEOUT):
        self.rank = rank
        self.world_size = world_size
        # The launcher hosts the store; ranks are clients only, so no rank ever listens on the
        # store port (and no libuv server with its io_uring fd lives in a rank).
        self._store = dist.TCPStore(master_addr, int(master_port), world_size, is_master=False,
                                    timeout=timeout)
        self._prefix_store = dist.PrefixStore(key_prefix, self._store)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_addr)]
        self.pg = dist.ProcessGroupGloo(self._prefix_store, rank, world_size, options)
        # The options keep the gloo Device, and the Device keeps a listening socket.
        del options

    def close(self):
        self.pg = None
        self._prefix_store = None
        self._store = None
        gc.collect()


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


def _done_work(result):
    future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _reduce_in_rank_order(gathered, op):
    result = gathered[0].clone()
    for other in gathered[1:]:
        if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            result.add_(other)
        elif op == dist.ReduceOp.PRODUCT:
            result.mul_(other)
        elif op == dist.ReduceOp.MAX:
            torch.maximum(result, other, out=result)
        elif op == dist.ReduceOp.MIN:
            torch.minimum(result, other, out=result)
        else:
            raise NotImplementedError(f"meridian virtual group: reduce op {op} is not supported")
    if op == dist.ReduceOp.AVG:
        if result.is_floating_point():
            result.div_(len(gathered))
        else:
            result.div_(len(gathered), rounding_mode="floor")
    return result


class VirtualProcessGroup(dist.ProcessGroup):
    """The group the user's script sees. Collectives are synchronous and deterministic."""

    def __init__(self, rank, world_size, connect, hooks):
        super().__init__(rank, world_size)
        self._rank = rank
        self._world_size = world_size
        self._connect = connect
        self._hooks = hooks
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
        # An in-flight meta-allreduce keeps the old communicator (and its sockets) alive, and
        # every rank started it: finish it first.
        pending = _state.get("pending_meta")
        if pending is not None:
            pending.wait()
            _state["pending_meta"] = None
        if self.inner is not None:
            self.inner.close()
            self.inner = None

    def getBackendName(self):
        return BACKEND_NAME

    def shutdown(self):
        self.close_inner()

    def abort(self):
        self.close_inner()

    # -- collectives ---------------------------------------------------------------------
    def _run(self, fn):
        inner = self.ensure_inner()
        self._hooks.before_collective()
        try:
            return fn(inner.pg)
        finally:
            self._hooks.after_collective()

    def allreduce(self, tensors, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        op = getattr(op, "op", op)

        def reduce_all(pg):
            for index, tensor in enumerate(tensors):
                source = tensor.detach().contiguous()
                flags = _state["outgoing_flags"] if index == 0 else None
                if flags is None:
                    gathered = [torch.empty_like(source) for _ in range(self._world_size)]
                    pg.allgather([gathered], [source]).wait()
                else:
                    # The cut's flags ride along as extra bytes: no extra round trip per step.
                    _state["outgoing_flags"] = None
                    payload = torch.cat([source.view(-1).view(torch.uint8),
                                         torch.tensor(flags, dtype=torch.int64).view(torch.uint8)])
                    packed = [torch.empty_like(payload) for _ in range(self._world_size)]
                    pg.allgather([packed], [payload]).wait()
                    size = source.numel() * source.element_size()
                    gathered = [p[:size].view(source.dtype).view(source.shape) for p in packed]
                    summed = [0] * len(flags)
                    for p in packed:  # integer sums: exact in any order
                        for i, value in enumerate(p[size:].clone().view(torch.int64).tolist()):
                            summed[i] += value
                    _state["carried_flags"] = summed
                tensor.copy_(_reduce_in_rank_order(gathered, op))
            return tensors
        return _done_work(self._run(reduce_all))

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        def bcast(pg):
            options = dist.BroadcastOptions()
            options.rootRank = opts.rootRank
            options.rootTensor = opts.rootTensor
            pg.broadcast(tensors, options).wait()
            return tensors
        return _done_work(self._run(bcast))

    def allgather(self, output_tensors, input_tensors, opts=None):
        def gather(pg):
            pg.allgather(output_tensors, input_tensors).wait()
            return output_tensors
        return _done_work(self._run(gather))

    def _allgather_base(self, output, input, opts=None):
        def gather(pg):
            chunks = list(output.chunk(self._world_size))
            pg.allgather([chunks], [input]).wait()
            return [output]
        return _done_work(self._run(gather))

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        op = getattr(op, "op", op)

        def reduce_scatter(pg):
            # Every chunk is gathered (W^2 traffic) so each rank sums its chunk in rank order.
            for output, inputs in zip(output_tensors, input_tensors):
                for index, chunk in enumerate(inputs):
                    source = chunk.detach().contiguous()
                    gathered = [torch.empty_like(source) for _ in range(self._world_size)]
                    pg.allgather([gathered], [source]).wait()
                    if index == self._rank:
                        output.copy_(_reduce_in_rank_order(gathered, op))
            return output_tensors
        return _done_work(self._run(reduce_scatter))

    def barrier(self, opts=None):
        def barrier(pg):
            pg.barrier().wait()
            return []
        return _done_work(self._run(barrier))


def meta_allreduce(values):
    """Sums a small int64 vector over all ranks through the inner group (exact, any order).

    Returns the input unchanged when no process group was initialised (a single-process job).
    """
    group = _state["group"]
    tensor = torch.tensor(values, dtype=torch.int64)
    if group is None or group._world_size == 1:
        return tensor.tolist()
    inner = group.ensure_inner()
    group._hooks.before_collective()
    try:
        inner.pg.allreduce([tensor]).wait()
    finally:
        group._hooks.after_collective()
    return tensor.tolist()


class _Pending:
    """An in-flight meta-allreduce; wait() returns the summed values."""

    def __init__(self, tensor, work, hooks):
        self.tensor, self.work, self.hooks = tensor, work, hooks

    def wait(self):
        if self.work is not None:
            self.hooks.before_collective()
            try:
                self.work.wait()
            finally:
                self.hooks.after_collective()
            self.work = None
        return self.tensor.tolist()


def meta_allreduce_async(values):
    """Starts the same sum as meta_allreduce without waiting; returns a handle with wait().

    Lets the cut's flags travel while the next step computes (the barrier decides one step
    later). Every rank must wait() its handle before the inner group is closed."""
    group = _state["group"]
    tensor = torch.tensor(values, dtype=torch.int64)
    if group is None or group._world_size == 1:
        return _Pending(tensor, None, None)
    handle = _Pending(tensor, group.ensure_inner().pg.allreduce([tensor]), group._hooks)
    _state["pending_meta"] = handle
    return handle


def send_flags_with_next_allreduce(values):
    """Attaches int64 values to this rank's next all-reduce; their sums over all ranks are then
    returned by take_carried_flags(). Every rank must call this at the same point."""
    _state["outgoing_flags"] = list(values)
    _state["carried_flags"] = None


def take_carried_flags():
    """Returns the summed flags carried by an all-reduce since send_flags_with_next_allreduce,
    or None when no all-reduce happened since (the flags are then withdrawn)."""
    carried = _state.get("carried_flags")
    _state["carried_flags"] = None
    _state["outgoing_flags"] = None
    return carried


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
            return InnerGroup(rank=rank, world_size=world_size, master_addr=master_addr,
                              master_port=master_port, key_prefix=key_prefix)
        group = VirtualProcessGroup(backend_options.group_rank, backend_options.group_size,
                                    connect, _state["hooks"])
        if _state["group"] is None:
            _state["group"] = group
        return group

    dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["cpu"])
    original = distributed_c10d.init_process_group

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1,
                           rank=-1, store=None, group_name="", pg_options=None,
                           device_id=None, **kwargs):
        requested = str(backend or "gloo").lower()
        if requested not in ("gloo", "cpu:gloo", BACKEND_NAME):
            raise RuntimeError(
                f"meridian-run: backend {backend!r} is not available in the CPU runtime; "
                "use 'gloo' (collectives then go through Meridian's virtual group)")
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
