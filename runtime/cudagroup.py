"""The CUDA side of the virtual group: an NCCL communicator of the devices' members (issue 17).

UNPROVEN ON GPU: nothing in this module has run on a CUDA device yet. It was written on a
machine without one (torch 2.13.0+cpu); only the refusal (`cuda_missing`) is exercised in CI.
bench/gpu_checks.py --checks fold is the prepared proof for a lent GPU (W = 2 and 4 folded on one
GPU against W = 4 unfolded, and the fold's cost per step against plain DDP over NCCL); its
--device cpu dry run proves the harness, not this module.
Multi-GPU NCCL cannot be proven on one GPU at all: with one device the members' communicator
has a single member and is never built, so the cross-device path below is reviewed, not run.

What a GPU job gets (`init_process_group("nccl")`, or backend=None when CUDA is available):
- the same virtual group and W-rank gloo group as a CPU job (control collectives, the cut's
  flags, broadcast and all-gather: CUDA tensors staged through host copies, vpg._staged);
- all-reduces through the fold (runtime/fold.py, runtime/hostchain.py open_per_device): the ranks
  of one device write their piece into their host's shared area (a device -> host copy), the
  device's member combines their rows on its device in rank order, continues the running partial
  it receives from the previous device's member over NCCL send/recv, and so on; the result
  comes back the same way (host -> device copy). One NCCL member per device, as NCCL requires.
  The co-located ranks' staging through host memory is the simple, correct choice; CUDA IPC
  between the rank processes (no host copy) is the faster one left for later, and the cost goal
  (<= 2% over plain DDP) is not expected from the staged path.
- the members' communicator is a ProcessGroupNCCL on the inner group's store (a prefix of its
  own), built when the inner group is built, and aborted (ncclCommAbort through torch's
  ProcessGroupNCCL.abort) at every cut, before CRIU or the CUDA checkpoint API runs: NCCL
  communicators cannot be checkpointed. The next inner group builds a new one, possibly on other
  devices and hosts. Relies on: torch's ProcessGroupNCCL (NCCL >= 2.18 for abort without a hang;
  nothing newer: no ncclCommShrink/Grow/Suspend), point-to-point send/recv (a pair's operations
  run in issue order, which the chain's posting order respects), and `abort()` on the group.
"""
import os

import torch

CUDA_BACKENDS = ("nccl", "cuda:nccl", "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo")
# Set by the launcher for each rank of a GPU job under an agent (runtime/launcher.py rank_env): the
# index, among the CUDA devices the rank sees, of the GPU its device map gives it. LOCAL_RANK says
# the same to the script (a spliced job's co-located ranks share it); this one the script cannot
# have changed.
CUDA_DEVICE_ENV = "MERIDIAN_CUDA_DEVICE"
# Set beside it (and at every resume, from the resume file): the UUID of that GPU. A CRIU restore
# may move the rank's CUDA state onto another GPU under the same device index (runtime/criu_cuda.py),
# which torch's cached device properties do not see.
CUDA_GPU_ENV = "MERIDIAN_CUDA_GPU"


def cuda_missing():
    """Returns why this rank cannot run a CUDA job (a sentence naming what is missing), or None
    when a CUDA device is visible."""
    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is built without CUDA; install a CUDA build of "
                "torch in the job's environment")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not torch.cuda.is_available():
        if visible is not None and visible.strip() in ("", "-1"):
            return f"no CUDA device is visible to this rank (CUDA_VISIBLE_DEVICES={visible!r})"
        return ("torch was built with CUDA but sees no device (no NVIDIA driver, or no GPU on this "
                f"node; CUDA_VISIBLE_DEVICES={visible!r})")
    return None


def refusal(backend):
    """The message a script gets when it asks for `backend` (NCCL) on a rank without CUDA."""
    return (f"meridian-run: backend {backend!r} needs a CUDA device, and {cuda_missing()}. "
            "Submit the job for GPU devices (it then runs where CUDA is visible), or ask for 'gloo' "
            "to train on CPU devices")


def given_device():
    """Returns the CUDA device index the launcher gave this rank (CUDA_DEVICE_ENV), or None (a
    launcher started by hand: the rank's device is the script's choice)."""
    given = os.environ.get(CUDA_DEVICE_ENV, "")
    return int(given) if given.isdigit() else None


def rank_device():
    """This rank's CUDA device index: the one its launcher gave it, else the current device."""
    given = given_device()
    return given if given is not None else torch.cuda.current_device()


def device_key():
    """Returns a 63-bit job-wide key of this rank's physical CUDA device (from its UUID): the
    fold's grouping key on GPUs. Not the launcher's logical device number: ranks on several
    logical devices of one GPU must fold onto one member too (NCCL refuses one GPU twice). The
    launcher's word for it first (CUDA_GPU_ENV), then torch's."""
    import hashlib
    identity = os.environ.get(CUDA_GPU_ENV, "")
    if not identity:
        properties = torch.cuda.get_device_properties(rank_device())
        identity = str(getattr(properties, "uuid", "")) or f"{os.uname().nodename}/{properties.pci_bus_id}"
    return int.from_bytes(hashlib.sha256(identity.encode()).digest()[:7], "little")


def member_device():
    """The CUDA device this rank's members' communicator and messages use: the rank's (rank_device)."""
    return torch.device("cuda", rank_device())


class NcclMembersGroup:
    """The devices' members' NCCL communicator: send/recv for the chain (runtime/hostchain.py),
    abort_communicator() at a cut. UNPROVEN ON GPU (see the module docstring)."""

    def __init__(self, store, index, size, *, timeout):
        import torch.distributed as dist
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        self.pg = dist.ProcessGroupNCCL(store, index, size, options)
        self.index, self.size = index, size

    def send(self, tensors, peer, tag):
        return self.pg.send(tensors, peer, 0)  # NCCL has no tags: a pair's messages stay in order

    def recv(self, tensors, peer, tag):
        return self.pg.recv(tensors, peer, 0)

    def abort_communicator(self):
        """Aborts the NCCL communicator (ncclCommAbort): no collective of it may be in flight
        afterwards, and nothing of it is left for a checkpoint to trip over."""
        pg, self.pg = self.pg, None
        if pg is None:
            return
        torch.cuda.synchronize()  # every send/recv the chain waited for has really finished
        abort = getattr(pg, "abort", None) or getattr(pg, "shutdown", None)
        if abort is not None:
            abort()


def nccl_members_group(timeout):
    """Returns the members_group factory of vpg.InnerGroup for a GPU job."""
    def make(store, index, size):
        return NcclMembersGroup(store, index, size, timeout=timeout)
    return make
