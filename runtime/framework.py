"""Framework checkpoint engine: checkpoint and resume an unmodified PyTorch script without CRIU.

``runtime.rank`` calls :func:`install` before it runs the user's script.  ``install`` wraps the
constructors of ``nn.Module``, ``torch.optim.Optimizer``, the LR schedulers,
``torch.amp.GradScaler`` (and its ``step``) and ``DataLoader`` (and ``DataLoader.__iter__``), and
registers one global optimizer post-step hook.  From then on the tracker knows, in construction
order, every model, optimizer, scheduler, grad scaler and loader of the script, and where each
loader is (epoch, batches consumed, RNG state before the epoch began).

The cut.  After every optimizer step (every completed cycle of steps when a script has several
optimizers) the post-step hook bumps ``tracker.step`` and calls the step listeners; a listener
(the consistent-cut barrier) may call ``tracker.save(directory)`` there.  ``save`` writes the
state *at that point*: module state dicts and train/eval flags, optimizer and scheduler state
dicts, every loader's position, the python / numpy / torch RNG states.

Resume.  The script is run again from the top with ``resume_dir``.  Objects are built as
before; each optimizer, scheduler and loader is checked against the recorded one as it is
constructed (order + structural fingerprint).  Epochs the loader had finished come back as empty
iterators, so the script's per-epoch code runs again with nothing to train on.  When the script
asks for the epoch that was in progress at the cut (the *apply point*) every recorded state is
loaded, the loader's RNG state from before that epoch is put back, the real iterator is created
and the consumed batches are fetched again and discarded (so a worker's augmentation RNG advances
exactly as it did), then the RNG states of the cut are restored.  The script continues with the
batch after the cut.

Code that ran between ``optimizer.step()`` and the next batch in the cut iteration is not run
again.  The tracker watches that stretch on every step: LR scheduler steps there are replayed on
resume (same count per step, observed), an AMP GradScaler's update() there is computed at the cut
from the inf checks its step() recorded (and that prediction is checked against the real update on
every step), while RNG draws or hyper-parameter changes there make the script unresumable, and
``check_resumable`` / ``save`` say so instead of writing a checkpoint that would resume wrong.
See the README ("The framework engine") for the full list.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import random
import shutil
import sys
import threading
import time
import uuid
import warnings
import weakref
from pathlib import Path
from typing import IO, Any, cast

import numpy as np
import torch
import torch.nn as nn
import torch.optim.lr_scheduler as lr_scheduler
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import DataLoader

from runtime import cudagroup, store

ENGINE = "framework"
FORMAT = 2  # 2: with the witness (a format-1 checkpoint cannot prove the re-run is the same run)
STATE_FILE = "state.pt"
RANK_DIR = "rank-{rank}"
EXIT_NEVER_APPLIED = 75

_SCHEDULER_CLASSES = (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau,
                      lr_scheduler.SequentialLR, lr_scheduler.ChainedScheduler)

_active_tracker: "FrameworkTracker | None" = None


class UnresumableScript(Exception):
    """The script does something the framework engine cannot checkpoint or resume correctly.
    ``reason`` says what, in words a script author can act on."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(f"framework checkpoint engine: {reason}")


def install(*, rank: int = 0, world_size: int = 1, resume_dir=None) -> "FrameworkTracker":
    """Starts tracking the process's models, optimizers, schedulers and loaders and returns the
    tracker. Call once per process, before the user's script runs.

    With ``resume_dir`` (a directory holding ``rank-<r>/``), this rank's checkpoint is verified
    (sha256) and loaded now; a missing or corrupt file or a different world size raises
    UnresumableScript before the script starts."""
    global _active_tracker
    if _active_tracker is not None:
        raise RuntimeError("runtime.framework.install() was already called in this process")
    tracker = FrameworkTracker(rank=int(rank), world_size=int(world_size),
                               resume_dir=resume_dir)
    tracker._patch()
    _active_tracker = tracker
    return tracker


def installed() -> "FrameworkTracker | None":
    return _active_tracker


# --------------------------------------------------------------------------- helpers

def _rng_state() -> dict:
    # numpy's state as plain Python values (its key array as a list of ints): a checkpoint holds
    # tensors and plain containers only, so it loads with torch.load(weights_only=True).
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (str(name), np.asarray(keys).tolist(), int(position), int(has_gauss), float(cached_gaussian)),
        "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
        state["cuda_device"] = cudagroup.given_device()
    return state


def _set_rng_state(state: dict) -> None:
    """Puts back what _rng_state saved; the CUDA generators as _cuda_rng_placement places them
    (raises UnresumableScript where they cannot be)."""
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        placement, problem = _cuda_rng_placement(state, device=cudagroup.given_device(),
                                                 visible=_visible_cuda_devices())
        if problem:
            raise UnresumableScript(problem)
        for index, generator_state in placement.items():
            torch.cuda.set_rng_state(generator_state, index)


def _visible_cuda_devices() -> int:
    """How many CUDA devices this rank sees (0 without CUDA). Creates no CUDA context, but loads
    the driver into the process (see _load_resume)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _device_bytes(tree) -> int:
    """Returns the bytes of the tensors in `tree` (dicts, lists, tuples) that live on a device other
    than the CPU: what a save copies from the device to the host. Each storage counted once (tied
    weights, views); a tensor whose storage has no address (the meta device's) once per tensor."""
    seen: set = set()
    total = 0
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, torch.Tensor) and item.device.type != "cpu":
            storage = item.untyped_storage()
            key = (str(item.device), storage.data_ptr()) if storage.data_ptr() else id(item)
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def _generator_drawn(generator_state: torch.Tensor) -> bool:
    """True when a CUDA generator's saved state shows random numbers drawn since it was seeded: its
    Philox offset (the state's last 8 bytes, after the seed) is not 0. A state of another layout
    counts as drawn (the caller then refuses rather than guess)."""
    if generator_state.dtype != torch.uint8 or generator_state.numel() < 16:
        return True
    return int(generator_state[-8:].clone().view(torch.int64).item()) != 0


def _cuda_rng_placement(state: dict, *, device: int | None, visible: int) -> tuple[dict, str | None]:
    """Returns ({device index: generator state} to put back, None), or ({}, why not) for the CUDA
    generators of `state` (an _rng_state) on a rank that sees `visible` CUDA devices and was given
    device `device` (None: not known).

    torch keeps one generator per device, indexed by the device's number in the process. A GPU
    job's rank uses the GPU its launcher gave it (LOCAL_RANK), whose number can change from one
    launch to the next (a resize, a migration to another host's GPUs): its own generator then
    follows it to its new number. A generator of another device that the rank drew from cannot
    follow it anywhere meaningful, and is refused when the rank moved or that device is gone; one
    it never drew from is left as the re-run seeded it (the same seed, nothing drawn). Where the
    rank's device is not known on either side (a launcher started by hand), the generators go
    back index for index, so the rank must see at least as many devices as at the cut."""
    saved = list(state.get("cuda", ()))
    own = state.get("cuda_device")
    if own is None or device is None:
        if len(saved) > visible:
            return {}, (f"the checkpoint holds the CUDA random generators of {len(saved)} device(s) and this rank "
                        f"sees {visible}: resume the job where each rank sees as many GPUs as at the cut (the same "
                        f"GPU count per host), or from a checkpoint taken on this layout")
        return dict(enumerate(saved)), None
    if not 0 <= own < len(saved) or not 0 <= device < visible:
        return {}, (f"the rank's GPU was device {own} of {len(saved)} at the cut and is device {device} of the "
                    f"{visible} it sees now: one of them is not a device of the rank (a damaged checkpoint, or "
                    f"a launch that gave it no GPU)")
    placement = {device: saved[own]}
    for index, generator_state in enumerate(saved):
        if index == own or not _generator_drawn(generator_state):
            continue
        if own != device:
            return {}, (f"the rank moved from CUDA device {own} to device {device} and had drawn random numbers "
                        f"on device {index} besides its own: that stream cannot follow it; draw only on the "
                        f"rank's GPU (the one LOCAL_RANK names), or resume the job where each rank keeps its GPU")
        if index >= visible:
            return {}, (f"the rank drew random numbers on CUDA device {index} besides its own (device {own}) and "
                        f"sees {visible} device(s) now: resume the job where each rank sees as many GPUs as at "
                        f"the cut")
        placement[index] = generator_state
    return placement, None


def _rng_equal(a: dict, b: dict) -> bool:
    return (a["python"] == b["python"] and torch.equal(a["torch"], b["torch"])
            and tuple(a["numpy"]) == tuple(b["numpy"]))


def _module_fingerprint(module: nn.Module) -> list:
    return [type(module).__qualname__] + [
        [name, list(t.shape), str(t.dtype)]
        for name, t in module.state_dict(keep_vars=True).items()]


def _has_state(module: nn.Module) -> bool:
    for _ in module.parameters():
        return True
    for _ in module.buffers():
        return True
    return False


def _hyperparams(optimizer) -> list:
    return [{k: v for k, v in group.items()
             if k != "params" and isinstance(v, (int, float, bool, str, type(None)))}
            for group in optimizer.param_groups]


def _scheduler_counter(scheduler):
    count = getattr(scheduler, "last_epoch", None)
    return getattr(scheduler, "_step_count", None) if count is None else count


def _scaler_after_update(scaler):
    """Returns (scale, growth tracker) as tensors: what an enabled torch.amp.GradScaler holds
    once the script's update() after this step has run, computed now, at the cut (which comes
    between step() and update()), the way update() computes it from the inf checks its step()
    recorded; its current values when no inf check was recorded. None for a disabled scaler or
    one that has not scaled yet (its lazily built scale starts from its init values either way)."""
    if not scaler.is_enabled() or scaler._scale is None:
        return None
    scale, tracker = scaler._scale.clone(), scaler._growth_tracker.clone()
    found = [inf.to(device=scale.device) for state in scaler._per_optimizer_states.values()
             for inf in state["found_inf_per_device"].values()]
    if found:
        combined = found[0].clone()
        for inf in found[1:]:
            combined += inf
        torch._amp_update_scale_(scale, tracker, combined, scaler._growth_factor,
                                 scaler._backoff_factor, scaler._growth_interval)
    return scale, tracker


def _scaler_mismatch(scaler, predicted):
    """A bool tensor on the scaler's device, true where its state at the next batch is not what
    _scaler_after_update predicted at the step (the script's update() is then not the one the cut
    saves); None when there is nothing to compare. Computed on the device without waiting for it:
    a comparison read on the host every step would stall a GPU's queue at every batch. Read at a
    cut only (FrameworkTracker.check_resumable)."""
    if predicted is None or scaler._scale is None:
        return None
    scale, tracker = predicted
    return (scaler._scale != scale).any() | (scaler._growth_tracker != tracker).any()


SCALER_REFUSAL = ("after a step, the torch.amp.GradScaler's scale was not what its update() after "
                  "step() gives: the script sets the scale itself (update(new_scale)) or changes the "
                  "scaler between step() and the next batch; the engine cannot replay that at a resume")


def _index_of(optimizer, optimizers: list) -> int:
    """`optimizer`'s place among `optimizers` (the live tracked ones), -1 for one built untracked."""
    return next((i for i, o in enumerate(optimizers) if o is optimizer), -1)


def _loader_generators(loader) -> list:
    """The torch.Generators a loader draws from: its own and its sampler's, if any."""
    found: list[torch.Generator] = []
    for gen in (getattr(loader, "generator", None),
                getattr(getattr(loader, "sampler", None), "generator", None),
                getattr(getattr(getattr(loader, "batch_sampler", None), "sampler", None),
                        "generator", None)):
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
    return found


# ------------------------------------------------------------------ the witness (digests)
#
# A resume re-runs the script, which rebuilds its data and models before any state is restored.
# If the re-run builds something else (an unseeded model or dataset, data ordered by the clock,
# the script's own snapshot loaded at start), restoring the checkpoint into it and fast-forwarding
# would train a different model and report success. So the first run records a *witness* of what
# the script had built, and a resume compares before it goes on:
#   - at the script's first DataLoader epoch (the first ``__iter__``): a digest of every model's
#     state and every optimizer's state, and the sampler epoch of every later epoch;
#   - every batch fetched: a digest, kept for the epoch in progress; at the apply point the
#     batches fetched again are compared one by one, (epoch, index), with the first run's.
# A mismatch raises UnresumableScript naming what differs. Tensors larger than _FULL_BYTES are
# digested from their first and last _SAMPLE_BYTES and a strided sample of the middle (a
# different initialisation or dataset changes every element; a sample sees it).

_FULL_BYTES = 4 << 20
_SAMPLE_BYTES = 1 << 20
_DIGEST_SIZE = 8


def _update_with_tensor(h, tensor: torch.Tensor) -> None:
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    h.update(f"T{t.dtype}{tuple(t.shape)}|".encode())
    if t.is_sparse or t.layout != torch.strided:
        t = t.to_dense()
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    raw = flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)
    if raw.numel() <= _FULL_BYTES:
        h.update(raw.numpy().tobytes())
        return
    stride = max(1, raw.numel() // _SAMPLE_BYTES)
    for part in (raw[:_SAMPLE_BYTES], raw[-_SAMPLE_BYTES:], raw[::stride]):
        h.update(part.numpy().tobytes())


def _update_with(h, value, depth=0) -> None:
    if depth > 20:
        h.update(b"...")
    elif isinstance(value, torch.Tensor):
        _update_with_tensor(h, value)
    elif isinstance(value, np.ndarray):
        _update_with_tensor(h, torch.from_numpy(np.ascontiguousarray(value)))
    elif isinstance(value, dict):
        h.update(b"{")
        for key, item in value.items():
            h.update(repr(key).encode()[:200])
            _update_with(h, item, depth + 1)
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for item in value:
            _update_with(h, item, depth + 1)
        h.update(b"]")
    elif isinstance(value, (int, float, bool, str, bytes, type(None))):
        h.update(repr(value).encode()[:4096])
    else:
        h.update(type(value).__qualname__.encode())


def _digest(value) -> bytes:
    import hashlib
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    _update_with(h, value)
    return h.digest()


def _optimizer_digest(optimizer) -> bytes:
    state = optimizer.state_dict()
    return _digest([state["state"], [{k: v for k, v in g.items() if k != "params"}
                                     for g in state["param_groups"]]])


def _sampler_epoch(loader):
    for sampler in (getattr(loader, "sampler", None),
                    getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        epoch = getattr(sampler, "epoch", None)
        if isinstance(epoch, int):
            return epoch
    return None


@contextlib.contextmanager
def _no_zip_crc32():
    """torch.save computes a CRC-32 of every record on the calling thread (about 0.5 s per 3 GB
    here) that torch.load never checks. Our checkpoint files carry a sha256 that every restore
    checks, so the CRC is skipped for them (the file stays a zip torch.load reads; its CRC
    fields are 0). torch's switch is process-wide: it is set back right after the save."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


class _LoaderRecord:
    def __init__(self, seq: int, loader):
        self.seq = seq
        self.ref = weakref.ref(loader)
        self.epochs: list[list] = []      # per __iter__ call: [batches consumed, exhausted]
        self.pre_epoch_rng: dict | None = None   # RNG before the latest __iter__ call
        self.pre_epoch_generators: list = []
        self.live_iterator = None         # weakref to the latest iterator
        self.fingerprint = _loader_fingerprint(loader)
        self.digests = bytearray()        # the latest epoch's batch digests, _DIGEST_SIZE each
        self.sampler_epochs: list = []    # per __iter__ call: the sampler's epoch attribute


def _loader_fingerprint(loader) -> dict:
    dataset = loader.dataset
    try:
        dataset_len = len(dataset)
    except TypeError:
        dataset_len = None
    try:
        batches = len(loader)
    except TypeError:
        batches = None
    return {"class": type(loader).__qualname__, "dataset": type(dataset).__qualname__,
            "dataset_len": dataset_len, "batches": batches, "batch_size": loader.batch_size,
            "drop_last": loader.drop_last, "num_workers": loader.num_workers}


class _TrackedIterator:
    """Wraps a DataLoader iterator: counts batches and lets the tracker look at each fetch."""

    def __init__(self, tracker, record, epoch_index, inner):
        self._tracker = tracker
        self._record = record
        self._epoch_index = epoch_index
        self._inner = inner

    def __iter__(self):
        return self

    def __next__(self):
        self._tracker._before_fetch(self._record)
        try:
            batch = next(self._inner)
        except StopIteration:
            self._record.epochs[self._epoch_index][1] = True
            raise
        self._record.epochs[self._epoch_index][0] += 1
        if self._epoch_index == len(self._record.epochs) - 1:
            self._record.digests += _digest(batch)
        self._tracker._active_loader = self._record
        return batch

    def __len__(self):
        return len(self._inner)

    def __getattr__(self, name):
        return getattr(self._inner, name)


# --------------------------------------------------------------------------- the tracker

class FrameworkTracker:
    """What ``install`` returns. ``step`` counts optimizer steps (completed cycles when a script
    has several optimizers) since the job began, resumed ones included."""

    def __init__(self, *, rank: int, world_size: int, resume_dir=None):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} / world size {world_size} is not a valid pair")
        self.rank = rank
        self.world_size = world_size
        self.step = 0
        self._listeners: list = []
        self._seq = 0
        self._modules: list = []      # (seq, weakref) of every nn.Module built, in order
        self._optimizers: list = []   # (seq, weakref)
        self._schedulers: list = []
        self._scalers: list = []      # (seq, weakref) of every torch.amp.GradScaler built
        self._scaler_flag = None  # device bool: a scaler's update() differed from the cut's prediction
        self.last_save: tuple[float, int] = (0.0, 0)  # the last save()'s seconds and device bytes
        self._loaders: list[_LoaderRecord] = []
        self._active_loader: _LoaderRecord | None = None
        self._reasons: list[str] = []          # why the script cannot be resumed, if ever
        self._cycle: tuple | None = None       # optimizer indexes stepped per iteration
        self._steps_since_fetch: list[int] = []
        self._pending: dict | None = None      # snapshot at the last post-step, until a fetch
        self._replay: list | None = None       # scheduler steps seen between step() and fetch
        self._observed_intervals = 0
        self._handles: list = []
        self._originals: list = []
        self._tensors_upto = 0
        self._tensors_dirty = True
        self._tensors: list = []
        self._resume = None
        self._witness: dict | None = None      # what the script built at its first epoch
        self._loaded_files: list[str] = []     # files the script torch.load-ed before that
        self._applied = resume_dir is None
        # A resume's stages: store -> host seconds here, then once the states are in the live objects
        # `on_applied(step, load_s, apply_s, device_bytes)` hears the apply's seconds and the bytes
        # that went to devices (runtime/rank.py tells the launcher).
        self.load_s: float | None = None
        self.on_applied = None
        if resume_dir is not None:
            began = time.monotonic()
            self._resume = self._load_resume(Path(resume_dir))
            self.load_s = time.monotonic() - began

    # ----------------------------------------------------------------- public API

    def add_step_listener(self, fn) -> None:
        """Calls ``fn(step)`` after every optimizer step (cycle), in registration order."""
        self._listeners.append(fn)

    def check_resumable(self) -> None:
        """Raises UnresumableScript if a checkpoint taken now would not resume correctly."""
        if not self._applied:
            raise UnresumableScript("the resumed script has not reached its checkpointed "
                                    "DataLoader position yet")
        if self._scaler_flag is not None and bool(self._scaler_flag):
            self._reasons.append(SCALER_REFUSAL)
            self._scaler_flag = None
        if self._reasons:
            raise UnresumableScript("; ".join(dict.fromkeys(self._reasons)))
        if not self._live(self._optimizers):
            raise UnresumableScript("no torch.optim optimizer was built; nothing to resume")
        if self._active_loader is None:
            raise UnresumableScript(
                "no batch has been fetched from a torch DataLoader; the framework engine resumes "
                "a script at a DataLoader position and cannot fast-forward other loops")
        if self._observed_intervals == 0:
            raise UnresumableScript(
                "no optimizer step has been followed by its next batch yet, so what the script "
                "does between step() and the next batch is unknown; cut after a later step")
        busy = [rec for rec in self._loaders
                if rec is not self._active_loader and rec.epochs and not rec.epochs[-1][1]
                and rec.live_iterator is not None and rec.live_iterator() is not None]
        if busy:
            raise UnresumableScript(
                f"{len(busy) + 1} DataLoaders are in the middle of an epoch at once (e.g. zip of "
                f"two loaders); only one loader may be mid-epoch at a cut")

    def no_cut_reason(self) -> str | None:
        """Why this script can never reach a framework cut, or None (it may: wait for a step).
        The cut fires only right after a torch.optim optimizer's step(); a script that builds
        none (manual updates: ``p.data.add_(p.grad, alpha=-lr)``) never gets there. Said only
        once the script is seen training (it iterated a DataLoader) without one: a script still
        starting (importing, building its model, or a resumed copy before its first epoch) has
        simply not built its optimizer yet, and its cut comes with its first step. A script that
        trains without a DataLoader and without torch.optim is not recognised: its stop waits."""
        training = any(record.epochs for record in self._loaders)
        if self.step == 0 and training and not self._live(self._optimizers):
            return ("the script builds no torch.optim optimizer (manual parameter updates such as "
                    "p.data.add_(p.grad, alpha=-lr)?): the framework engine cuts only right after "
                    "optimizer.step(), so it can never stop or checkpoint this job; run it with "
                    "--engine criu, or update the parameters with a torch.optim optimizer")
        return None

    def save(self, directory) -> Path:
        """Writes this rank's state at the current cut to ``directory/rank-<r>/`` atomically
        (temporary folder, fsync, rename) with a manifest (engine, step, world size, sha256 and
        size of each file). Returns the rank folder. Raises UnresumableScript, writing nothing,
        when ``check_resumable`` would."""
        directory = Path(directory)
        if directory.name.startswith(store.STAGING_PREFIX):
            if not directory.is_dir():  # never recreated: a sweep took it for abandoned (store.py)
                raise FileNotFoundError(f"the checkpoint's staging folder {directory} is gone (swept as "
                                        "abandoned, or its checkpoint was given up): nothing saved")
        self.check_resumable()
        began = time.monotonic()
        state = self._collect()
        directory.mkdir(parents=True, exist_ok=True)
        final = directory / RANK_DIR.format(rank=self.rank)
        if final.exists():
            raise FileExistsError(f"{final} already exists; save each checkpoint to a new folder")
        tmp = directory / f".tmp-{final.name}-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            writer = store.HashingFileWriter(tmp / STATE_FILE)
            try:
                with _no_zip_crc32():
                    torch.save(state, cast(IO[bytes], writer))  # a write()-only file object
                files = {STATE_FILE: writer.finish(fsync=True)}
            finally:
                writer.close()
            store.write_manifest(tmp, files, engine=ENGINE, step=self.step, rank=self.rank,
                                 world_size=self.world_size)
            os.rename(tmp, final)
            store.fsync_dir(directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.last_save = (time.monotonic() - began, _device_bytes(state))
        return final

    # ----------------------------------------------------------------- patching

    def _patch(self) -> None:
        tracker = self

        def patch(cls, name, replacement):  # untyped: mypy refuses assigning to a method
            self._originals.append((cls, name, cls.__dict__[name]))
            setattr(cls, name, replacement)

        def wrap_init(cls, note, check_after=True):
            original = cls.__dict__["__init__"]

            def __init__(obj, *args, **kwargs):
                note(obj)
                original(obj, *args, **kwargs)
                if check_after:
                    note(obj, constructed=True)
            __init__.__wrapped__ = original
            self._originals.append((cls, "__init__", original))
            cls.__init__ = __init__

        wrap_init(nn.Module, self._note_module, check_after=False)
        original_setstate = nn.Module.__dict__["__setstate__"]

        def __setstate__(module, state):
            original_setstate(module, state)
            tracker._note_module(module)
        patch(nn.Module, "__setstate__", __setstate__)

        wrap_init(torch.optim.Optimizer, self._note_optimizer)
        for cls in _SCHEDULER_CLASSES:
            wrap_init(cls, self._note_scheduler)
        wrap_init(DataLoader, self._note_loader)
        wrap_init(torch.amp.GradScaler, self._note_grad_scaler)
        original_scaler_step = torch.amp.GradScaler.__dict__["step"]

        def scaler_step(scaler, optimizer, *args, **kwargs):
            seen = len(tracker._steps_since_fetch)  # _post_step appends to it; no fetch runs in here
            result = original_scaler_step(scaler, optimizer, *args, **kwargs)
            if len(tracker._steps_since_fetch) == seen and scaler.is_enabled():
                tracker._skipped_step(optimizer)  # its gradients overflowed: step() was not called
            return result
        patch(torch.amp.GradScaler, "step", scaler_step)
        original_load = torch.load

        def load(f, *args, **kwargs):
            if tracker._witness is None and isinstance(f, (str, os.PathLike)):
                tracker._loaded_files.append(os.path.abspath(os.fspath(f)))
            return original_load(f, *args, **kwargs)
        self._originals.append((torch, "load", original_load))
        setattr(torch, "load", load)  # noqa: B010 - mypy refuses assigning to a module's function
        original_iter = DataLoader.__dict__["__iter__"]

        def __iter__(loader):
            return tracker._loader_iter(loader, original_iter)
        patch(DataLoader, "__iter__", __iter__)
        self._patched_iter = __iter__
        self._handles.append(register_optimizer_step_post_hook(self._post_step))
        self._handles.append(register_optimizer_step_pre_hook(self._pre_step))
        if not self._applied:
            atexit.register(self._complain_if_never_applied)
            # Replayed (empty) epochs call the script's per-epoch scheduler.step() with no
            # optimizer step in between; torch warns once about that. Nothing is wrong: the
            # scheduler's state is overwritten at the apply point.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` "
                                    r"before `optimizer\.step\(\)`")

    def _unpatch(self) -> None:
        """Undoes install() (used by tests that run in one process)."""
        global _active_tracker
        for cls, name, original in reversed(self._originals):
            setattr(cls, name, original)
        for handle in self._handles:
            handle.remove()
        self._originals.clear()
        self._handles.clear()
        if _active_tracker is self:
            _active_tracker = None

    # ----------------------------------------------------------------- construction

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _note_module(self, module) -> None:
        self._modules.append((self._next_seq(), weakref.ref(module)))
        if len(self._modules) > 1024 and len(self._modules) & (len(self._modules) - 1) == 0:
            self._modules = [(s, r) for s, r in self._modules if r() is not None]
            self._tensors_upto = len(self._modules)
            self._tensors_dirty = True

    @staticmethod
    def _live(entries) -> list:
        return [obj for _, ref in entries if (obj := ref()) is not None]

    def _note_optimizer(self, optimizer, constructed=False) -> None:
        if not constructed:
            if any(ref() is optimizer for _, ref in self._optimizers):
                return
            self._optimizers.append((self._next_seq(), weakref.ref(optimizer)))
            return
        index = [ref() for _, ref in self._optimizers].index(optimizer)
        if self._resume is not None and not self._applied:
            saved = self._resume["optimizers"]
            if index >= len(saved):
                raise UnresumableScript(
                    f"optimizer #{index + 1} ({type(optimizer).__name__}) was not in the "
                    f"checkpoint, which has {len(saved)}; the script builds objects differently")
            mine = self._optimizer_shape(optimizer)
            if saved[index]["shape"] != mine:
                raise UnresumableScript(
                    f"optimizer #{index + 1} differs from the checkpoint: recorded "
                    f"{saved[index]['shape']}, built now {mine}")

    @staticmethod
    def _optimizer_shape(optimizer) -> list:
        return [type(optimizer).__qualname__] + [
            [list(p.shape) for p in group["params"]] for group in optimizer.param_groups]

    def _note_scheduler(self, scheduler, constructed=False) -> None:
        if not constructed:
            if any(ref() is scheduler for _, ref in self._schedulers):
                return
            self._schedulers.append((self._next_seq(), weakref.ref(scheduler)))
            return
        if self._resume is not None and not self._applied:
            index = [ref() for _, ref in self._schedulers].index(scheduler)
            saved = self._resume["schedulers"]
            if index >= len(saved) or saved[index]["class"] != type(scheduler).__qualname__:
                raise UnresumableScript(
                    f"LR scheduler #{index + 1} ({type(scheduler).__name__}) does not match the "
                    f"checkpoint's {[s['class'] for s in saved]}")

    def _note_grad_scaler(self, scaler, constructed=False) -> None:
        # Tracked, not refused: its update() after step() is predicted at the cut and checked on
        # every step (_scaler_after_update, _scaler_mismatch), see _post_step.
        if not constructed and not any(ref() is scaler for _, ref in self._scalers):
            self._scalers.append((self._next_seq(), weakref.ref(scaler)))

    def _note_loader(self, loader, constructed=False) -> None:
        if not constructed:
            return
        count = len(self._loaders)
        for old in self._loaders if count & (count - 1) == 0 else ():
            # a loader built per step must not keep its RNG copies forever
            if old.pre_epoch_rng is not None and old.ref() is None:
                old.pre_epoch_rng = None
                old.pre_epoch_generators = []
        record = _LoaderRecord(self._next_seq(), loader)
        self._loaders.append(record)
        if type(loader).__iter__ is not self._patched_iter:
            self._reasons.append(f"DataLoader subclass {type(loader).__name__} overrides "
                                 f"__iter__, so its position cannot be tracked")
        if loader.persistent_workers and loader.num_workers > 0:
            self._reasons.append("a DataLoader uses persistent_workers=True: its workers' RNG "
                                 "carries over between epochs and cannot be fast-forwarded")
        if self._resume is not None and not self._applied:
            index = len(self._loaders) - 1
            saved = self._resume["loaders"]
            if index >= len(saved):
                raise UnresumableScript(
                    f"DataLoader #{index + 1} was not in the checkpoint ({len(saved)} loaders)")
            if saved[index]["fingerprint"] != record.fingerprint:
                raise UnresumableScript(
                    f"DataLoader #{index + 1} differs from the checkpoint (dataset length, "
                    f"batch size, workers...): recorded {saved[index]['fingerprint']}, built "
                    f"now {record.fingerprint}")

    # ----------------------------------------------------------------- the training loop

    def _loader_iter(self, loader, original_iter):
        record = next((r for r in self._loaders if r.ref() is loader), None)
        if record is None:  # built before install(), or __init__ bypassed
            record = _LoaderRecord(self._next_seq(), loader)
            self._loaders.append(record)
        index = len(record.epochs)
        record.epochs.append([0, False])
        record.sampler_epochs.append(_sampler_epoch(loader))
        if self._witness is None:
            self._witness = self._take_witness()
            if self._resume is not None:
                self._check_witness(self._resume.get("witness"), self._witness)
        if self._resume is not None and not self._applied:
            self._check_sampler_epoch(record, index)
            return self._resumed_iter(record, index, loader, original_iter)
        record.digests = bytearray()
        record.pre_epoch_rng = _rng_state()
        record.pre_epoch_generators = [g.get_state() for g in _loader_generators(loader)]
        iterator = _TrackedIterator(self, record, index, original_iter(loader))
        record.live_iterator = weakref.ref(iterator)
        return iterator

    def _take_witness(self) -> dict:
        roots = self._roots()
        return {"modules": [[type(m).__qualname__, _digest(m.state_dict()).hex()] for m in roots],
                "optimizers": [[type(o).__qualname__, _optimizer_digest(o).hex()]
                               for o in self._live(self._optimizers)],
                "loaded": list(self._loaded_files)}

    def _check_witness(self, recorded, mine) -> None:
        """Refuses a resume whose re-run built other models or optimizer states, by the time of
        its first DataLoader epoch, than the run that was cut."""
        if recorded is None:
            raise UnresumableScript("the checkpoint holds no witness of the first run")
        loaded = ""
        if mine["loaded"] and mine["loaded"] != recorded["loaded"]:
            loaded = (f"; before its first epoch the re-run loaded {', '.join(mine['loaded'][:3])} "
                      f"with torch.load (the script's own snapshot/resume logic?), the first run "
                      f"loaded {', '.join(recorded['loaded'][:3]) or 'nothing'}")
        hint = (" (an unseeded script: torch.manual_seed / numpy / random not seeded, or data "
                "built from the clock or os.urandom; or the script restored its own snapshot)")
        for key, word, what, why in (
                ("modules", "model", "different parameters or buffers", hint),
                ("optimizers", "optimizer", "a different state or hyper-parameters",
                 " (the script restored its own optimizer snapshot?)")):
            if len(mine[key]) != len(recorded[key]):
                raise UnresumableScript(
                    f"the re-run is not the run that was cut: it holds {len(mine[key])} {word}s "
                    f"at its first DataLoader epoch, the first run held {len(recorded[key])}"
                    f"{loaded}")
            for i, (entry, rec) in enumerate(zip(mine[key], recorded[key])):
                if list(entry) != list(rec):
                    raise UnresumableScript(
                        f"the re-run is not the run that was cut: {word} #{i + 1} ({entry[0]}) "
                        f"has {what} at its first DataLoader epoch than in the first run{why}"
                        f"{loaded}; resuming would train a different model")

    def _check_sampler_epoch(self, record, index) -> None:
        assert self._resume is not None
        saved = self._resume["loaders"][self._loaders.index(record)]["sampler_epochs"]
        mine = record.sampler_epochs[index]
        if index < len(saved) and saved[index] != mine:
            raise UnresumableScript(
                f"DataLoader #{self._loaders.index(record) + 1}'s iteration #{index + 1} has "
                f"sampler epoch {mine}, the first run's had {saved[index]}: the script skips or "
                f"renumbers epochs on its own (its own resume logic?), so its epochs cannot be "
                f"matched with the checkpoint's")

    def _empty_iter(self, record, index):
        iterator = _TrackedIterator(self, record, index, iter(()))
        record.live_iterator = weakref.ref(iterator)
        return iterator

    def _resumed_iter(self, record, index, loader, original_iter):
        saved_loaders = self._resume["loaders"]
        loader_index = self._loaders.index(record)
        saved = saved_loaders[loader_index]
        saved_epochs = saved["epochs"]
        is_apply_point = (loader_index == self._resume["active_loader"]
                          and index == len(saved_epochs) - 1)
        if is_apply_point:
            return self._apply(record, index, loader, original_iter)
        if index < len(saved_epochs) and saved_epochs[index][1]:
            record.epochs[index] = list(saved_epochs[index])
            return self._empty_iter(record, index)
        if index < len(saved_epochs) and saved["batches"] is not None \
                and saved_epochs[index][0] >= saved["batches"]:
            record.epochs[index] = list(saved_epochs[index])
            return self._empty_iter(record, index)
        if loader_index == self._resume["active_loader"] and index >= len(saved_epochs):
            raise UnresumableScript(
                f"the resumed script iterated DataLoader #{loader_index + 1} more often "
                f"({index + 1}) than recorded at the cut ({len(saved_epochs)}) before reaching "
                f"the cut; its loop does not replay the same way")
        # an epoch the script abandoned early (e.g. next(iter(loader))), or one started later:
        # give the real thing; whatever it feeds is overwritten at the apply point
        record.pre_epoch_rng = _rng_state()
        iterator = _TrackedIterator(self, record, index, original_iter(loader))
        record.live_iterator = weakref.ref(iterator)
        return iterator

    def _before_fetch(self, record) -> None:
        if self._steps_since_fetch:
            cycle = tuple(self._steps_since_fetch)
            if self._cycle is None:
                self._cycle = cycle
                if len(self._live(self._optimizers)) > 1:
                    self.step += 1  # the first iteration, whose cycle was learnt only now
            elif cycle != self._cycle and len(self._live(self._optimizers)) > 1:
                self._reasons.append(
                    f"optimizers stepped in a varying order between batches ({self._cycle} then "
                    f"{cycle}); the cut iteration cannot be told apart")
            self._steps_since_fetch = []
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        # The stretch from step() to this fetch is code that a resume does not run again. (At an
        # epoch's end the fetch that raises StopIteration closes it, so per-epoch code after the
        # loop, which a resume does run, is never counted here.)
        self._observed_intervals += 1
        if not _rng_equal(pending["rng"], _rng_state()):
            self._reasons.append(
                "the script draws random numbers between optimizer.step() and the next batch; "
                "those draws cannot be replayed (move them before step() or into the dataset)")
        replay = []
        for sched, before in pending["schedulers"]:
            delta = (_scheduler_counter(sched) or 0) - (before or 0)
            if delta and isinstance(sched, lr_scheduler.ReduceLROnPlateau):
                self._reasons.append("ReduceLROnPlateau.step(metric) is called between "
                                     "optimizer.step() and the next batch; cannot replay it")
            replay.append(delta)
        if self._replay is None:
            self._replay = replay
        elif replay != self._replay:
            self._reasons.append(
                f"LR schedulers step a varying number of times between optimizer.step() and the "
                f"next batch ({self._replay} then {replay}); the cut iteration cannot be replayed")
        if not any(replay):
            for optimizer, before in pending["hyperparams"]:
                if _hyperparams(optimizer) != before:
                    self._reasons.append(
                        "optimizer hyper-parameters change between optimizer.step() and the next "
                        "batch without an LR scheduler; use a torch LR scheduler or change them "
                        "before step()")

        for scaler, predicted in pending["scalers"]:
            mismatch = _scaler_mismatch(scaler, predicted)
            if mismatch is not None:
                flags = self._scaler_flag
                self._scaler_flag = mismatch if flags is None else flags | mismatch.to(flags.device)

        tensors, versions = pending["versions"]
        if [t._version for t in tensors] != versions:
            self._reasons.append(
                "model parameters or buffers are modified between optimizer.step() and the next "
                "batch (an EMA or weight update after step()?); that update would be lost")

    def _state_tensors(self) -> list:
        """Parameters and buffers of the models. Recomputed only when a module with state was
        built since the last call (scripts often build a stateless loss module every step)."""
        new = self._modules[self._tensors_upto:]
        self._tensors_upto = len(self._modules)
        if self._tensors_dirty or any((m := ref()) is not None and _has_state(m)
                                      for _, ref in new):
            self._tensors_dirty = False
            self._tensors = [t for root in self._roots()
                             for t in (*root.parameters(), *root.buffers())]
        return self._tensors

    def _state_versions(self) -> tuple:
        # Every in-place change bumps a tensor's version counter: cheap change detection.
        tensors = self._state_tensors()
        return tensors, [t._version for t in tensors]

    def _pre_step(self, optimizer, args, kwargs) -> None:
        if not self._applied:
            raise UnresumableScript(
                "the resumed script called optimizer.step() before it reached the DataLoader "
                "epoch that was in progress at the cut; its loop does not replay the same way")

    def _skipped_step(self, optimizer) -> None:
        """A GradScaler skipped `optimizer`'s step() for an overflow. It still has its place in
        the iteration's cycle of optimizers (a GAN's critic skipped while its generator steps is
        the same iteration), but no post-step runs: no step is counted and no cut is taken."""
        self._steps_since_fetch.append(_index_of(optimizer, self._live(self._optimizers)))

    def _post_step(self, optimizer, args, kwargs) -> None:
        optimizers = self._live(self._optimizers)
        index = _index_of(optimizer, optimizers)
        if index < 0:
            self._reasons.append(
                f"optimizer {type(optimizer).__name__} was built without "
                f"torch.optim.Optimizer.__init__ (or before install()); its state is not tracked")
        self._steps_since_fetch.append(index)
        if len(optimizers) > 1 and tuple(self._steps_since_fetch) != self._cycle:
            return  # the iteration's cycle of optimizer steps is not complete (or not known)
        self.step += 1
        schedulers = self._top_level_schedulers()
        self._pending = {"rng": _rng_state(),
                         "schedulers": [(s, _scheduler_counter(s)) for s in schedulers],
                         "hyperparams": [(o, _hyperparams(o)) for o in optimizers],
                         "versions": self._state_versions(),
                         "scalers": [(scaler, _scaler_after_update(scaler))
                                     for scaler in self._live(self._scalers)]}
        for fn in list(self._listeners):
            fn(self.step)

    def _top_level_schedulers(self) -> list:
        live = self._live(self._schedulers)
        inner = {id(s) for outer in live for s in getattr(outer, "_schedulers", ()) or ()}
        return [s for s in live if id(s) not in inner]

    # ----------------------------------------------------------------- collect / apply

    def _roots(self) -> list:
        live = self._live(self._modules)
        children = {id(child) for m in live for child in m.children()}
        return [m for m in live if id(m) not in children and _has_state(m)]

    @staticmethod
    def _param_names(roots) -> dict:
        names: dict[int, str] = {}
        for i, root in enumerate(roots):
            for name, p in root.named_parameters(remove_duplicate=True):
                names.setdefault(id(p), f"{i}:{name}")
        return names

    def _collect(self) -> dict:
        roots = self._roots()
        names = self._param_names(roots)
        optimizers = self._live(self._optimizers)
        schedulers = self._top_level_schedulers()
        if self._active_loader is None:  # save() runs check_resumable first, which refuses this
            raise UnresumableScript("no batch has been fetched from a torch DataLoader")
        active = self._loaders.index(self._active_loader)
        loaders = []
        for record in self._loaders:
            loader = record.ref()
            loaders.append({
                "fingerprint": record.fingerprint, "epochs": [list(e) for e in record.epochs],
                "batches": record.fingerprint["batches"], "pre_epoch_rng": record.pre_epoch_rng,
                "pre_epoch_generators": record.pre_epoch_generators,
                "digests": bytes(record.digests).hex(), "sampler_epochs": list(record.sampler_epochs),
                "generators": [g.get_state() for g in _loader_generators(loader)]
                if loader is not None else []})
        return {
            "format": FORMAT, "engine": ENGINE, "step": self.step, "rank": self.rank,
            "world_size": self.world_size,
            "modules": [{"fingerprint": _module_fingerprint(m), "state": m.state_dict(),
                         "training": [sub.training for sub in m.modules()]} for m in roots],
            "optimizers": [{"shape": self._optimizer_shape(o),
                            "params": [[names.get(id(p), "?") for p in g["params"]]
                                       for g in o.param_groups],
                            "state": o.state_dict()} for o in optimizers],
            "schedulers": [{"class": type(s).__qualname__, "state": s.state_dict()}
                           for s in self._live(self._schedulers)],
            "top_level_schedulers": [self._live(self._schedulers).index(s) for s in schedulers],
            "scalers": self._scaler_states(),
            "replay": self._replay or [0] * len(schedulers),
            "cycle": self._cycle, "observed_intervals": self._observed_intervals,
            "loaders": loaders, "active_loader": active, "rng": _rng_state(),
            "witness": self._witness,
        }

    def _scaler_states(self) -> list:
        """Each GradScaler's state as the script's update() after the cut's step leaves it (the
        cut comes before update(); _post_step predicted it), as plain numbers."""
        predicted = {id(scaler): after for scaler, after in (self._pending or {}).get("scalers", ())}
        states = []
        for scaler in self._live(self._scalers):
            state = scaler.state_dict() if scaler.is_enabled() else {}
            after = predicted.get(id(scaler))
            if after is not None:
                state["scale"], state["_growth_tracker"] = after[0].item(), int(after[1].item())
            states.append({"enabled": scaler.is_enabled(), "state": state})
        return states

    def _load_resume(self, resume_dir: Path) -> dict:
        rank_dir = resume_dir / RANK_DIR.format(rank=self.rank)
        try:
            manifest = store.read_manifest(rank_dir)
        except store.CheckpointError as exc:
            raise UnresumableScript(f"cannot resume rank {self.rank} from {resume_dir}: {exc}") \
                from None
        if manifest.get("engine") != ENGINE:
            raise UnresumableScript(f"{rank_dir} was written by engine "
                                    f"{manifest.get('engine')!r}, not {ENGINE!r}")
        if manifest.get("world_size") != self.world_size:
            raise UnresumableScript(
                f"checkpoint {rank_dir} has world size {manifest.get('world_size')}, this job "
                f"runs {self.world_size}; the framework engine keeps the world size fixed")
        entry = manifest["files"].get(STATE_FILE)
        if entry is None:
            raise UnresumableScript(f"{rank_dir / store.MANIFEST_NAME} lists no {STATE_FILE}")
        # torch.load(weights_only=True) builds tensors and plain containers only: a planted file
        # cannot run code while it is parsed. So the sha256 runs on a second thread while the same
        # file is parsed (both release the GIL; hashing first would double a restore's time), and
        # nothing loaded is used before the digest matched the manifest.
        failure: list = []

        def check():
            try:
                store.verify_file(rank_dir / STATE_FILE, entry)
            except store.CheckpointError as exc:
                failure.append(exc)
        checker = threading.Thread(target=check, name="framework-sha256")
        checker.start()
        try:
            state = torch.load(rank_dir / STATE_FILE, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - every load failure is reported as UnresumableScript
            checker.join()
            if failure:
                raise UnresumableScript(f"cannot resume rank {self.rank}: {failure[0]}") from None
            raise UnresumableScript(f"cannot read {rank_dir / STATE_FILE}: {exc}") from None
        checker.join()
        if failure:
            raise UnresumableScript(f"cannot resume rank {self.rank}: {failure[0]}") from None
        if state.get("format") == 1:
            raise UnresumableScript(
                f"{rank_dir / STATE_FILE} was written by an older runtime (format 1) without a "
                f"witness of the first run, so a resume could not prove it rebuilds the same "
                f"model and data; restart the job or resume it with the runtime that wrote it")
        if state.get("format") != FORMAT or state.get("step") != manifest.get("step"):
            raise UnresumableScript(f"{rank_dir / STATE_FILE} does not match its manifest")
        # Asked only of a checkpoint with CUDA generators: even counting devices opens the NVIDIA
        # driver in this process, which a CPU job must never do (the CRIU engine refuses a rank
        # holding NVIDIA device files).
        problem = None
        if state.get("rng", {}).get("cuda"):
            _, problem = _cuda_rng_placement(state["rng"], device=cudagroup.given_device(),
                                             visible=_visible_cuda_devices())
        if problem:
            raise UnresumableScript(problem)
        return state

    @staticmethod
    def apply_states(saved: dict, roots: list, optimizers: list, schedulers: list) -> None:
        """Checks the live models / optimizers / schedulers against a loaded checkpoint (order
        and fingerprint) and loads their states; replays the scheduler steps the script makes
        between optimizer.step() and the next batch. Raises UnresumableScript on a mismatch
        before changing anything."""
        if len(roots) != len(saved["modules"]):
            raise UnresumableScript(
                f"the resumed script holds {len(roots)} models with state at the cut position, "
                f"the checkpoint has {len(saved['modules'])}")
        for i, (module, entry) in enumerate(zip(roots, saved["modules"])):
            mine = _module_fingerprint(module)
            if mine != entry["fingerprint"]:
                raise UnresumableScript(
                    f"model #{i + 1} differs from the checkpoint: recorded "
                    f"{entry['fingerprint'][:4]}..., built now {mine[:4]}...")
        names = FrameworkTracker._param_names(roots)
        if len(optimizers) != len(saved["optimizers"]):
            raise UnresumableScript(f"{len(optimizers)} optimizers built, the checkpoint has "
                                    f"{len(saved['optimizers'])}")
        for i, (optimizer, entry) in enumerate(zip(optimizers, saved["optimizers"])):
            mine = [[names.get(id(p), "?") for p in g["params"]] for g in optimizer.param_groups]
            if mine != entry["params"]:
                raise UnresumableScript(
                    f"optimizer #{i + 1} optimizes different parameters than at the cut "
                    f"(built in a different order?): recorded {entry['params']}, now {mine}")
        if [type(s).__qualname__ for s in schedulers] != [s["class"] for s in
                                                          saved["schedulers"]]:
            raise UnresumableScript("the LR schedulers differ from the checkpoint's")
        for module, entry in zip(roots, saved["modules"]):
            module.load_state_dict(entry["state"], strict=True)
            for sub, training in zip(module.modules(), entry["training"]):
                sub.training = training
        for optimizer, entry in zip(optimizers, saved["optimizers"]):
            optimizer.load_state_dict(entry["state"])
        for scheduler, entry in zip(schedulers, saved["schedulers"]):
            scheduler.load_state_dict(entry["state"])
        top = [schedulers[i] for i in saved["top_level_schedulers"]]
        for scheduler, count in zip(top, saved["replay"]):
            for _ in range(count):
                scheduler.step()

    def _apply(self, record, index, loader, original_iter):
        saved = self._resume
        began = time.monotonic()
        scalers = self._live(self._scalers)
        saved_scalers = saved.get("scalers", [])  # written since session 25; none enabled before
        built, recorded = [s.is_enabled() for s in scalers], [entry["enabled"] for entry in saved_scalers]
        if built != recorded:
            raise UnresumableScript(f"the resumed script built GradScalers enabled {built} by the epoch "
                                    f"in progress at the cut, the checkpoint has {recorded}")
        self.apply_states(saved, self._roots(), self._live(self._optimizers),
                          self._live(self._schedulers))
        for scaler, entry in zip(scalers, saved_scalers):
            if entry["enabled"]:
                scaler.load_state_dict(entry["state"])
        if self.on_applied is not None:  # the states are in the live objects (on their devices)
            roots, optimizers = self._roots(), self._live(self._optimizers)
            device_bytes = _device_bytes([[m.state_dict() for m in roots], [o.state_dict() for o in optimizers]])
            self.on_applied(saved["step"], self.load_s or 0.0, time.monotonic() - began, device_bytes)
        # this loader's epoch in progress: same RNG before it, same iterator, same batches
        loader_state = saved["loaders"][self._loaders.index(record)]
        position = loader_state["epochs"][index][0]
        _set_rng_state(loader_state["pre_epoch_rng"])
        for gen, gen_state in zip(_loader_generators(loader), loader_state["pre_epoch_generators"]):
            gen.set_state(gen_state)
        record.pre_epoch_rng = loader_state["pre_epoch_rng"]
        record.pre_epoch_generators = loader_state["pre_epoch_generators"]
        if loader_state["batches"] is not None and position >= loader_state["batches"]:
            inner = iter(())
        else:
            inner = original_iter(loader)
            recorded = bytes.fromhex(loader_state["digests"])
            for skipped in range(position):
                try:
                    batch = next(inner)
                except StopIteration:
                    raise UnresumableScript(
                        f"the DataLoader ran out after {skipped} batches while skipping the "
                        f"{position} consumed before the cut") from None
                # The first batch follows the restored pre-epoch RNG directly, and a worker's
                # batches come from worker RNGs seeded from it: those must come back the same.
                # A later batch of a loader without workers may draw from the main process's
                # RNG, which the first run's training steps had advanced in between: not compared.
                if skipped > 0 and loader.num_workers == 0:
                    continue
                expected = recorded[skipped * _DIGEST_SIZE:(skipped + 1) * _DIGEST_SIZE]
                if len(expected) != _DIGEST_SIZE or _digest(batch) != expected:
                    raise UnresumableScript(
                        f"the re-run is not the run that was cut: batch {skipped + 1} of the "
                        f"epoch in progress (DataLoader #{self._loaders.index(record) + 1}, "
                        f"iteration #{index + 1}) differs from the one the first run trained on; "
                        f"the data is built or ordered differently on each run (an unseeded "
                        f"dataset, data order from the clock or os.urandom, a random generator "
                        f"of the script's own that the engine cannot restore)")
            record.digests = bytearray(recorded[:position * _DIGEST_SIZE])  # as the first run's
        record.epochs[index] = [position, False]
        for other, other_state in zip(self._loaders, saved["loaders"]):
            other_loader = other.ref()
            if other_loader is not None:
                for gen, gen_state in zip(_loader_generators(other_loader),
                                          other_state["generators"]):
                    gen.set_state(gen_state)
        _set_rng_state(saved["rng"])
        self.step = saved["step"]
        self._cycle = tuple(saved["cycle"]) if saved["cycle"] is not None else None
        self._replay = list(saved["replay"])
        self._observed_intervals = saved["observed_intervals"]
        self._active_loader = record
        self._applied = True
        self._resume = None
        iterator = _TrackedIterator(self, record, index, inner)
        record.live_iterator = weakref.ref(iterator)
        return iterator

    def _complain_if_never_applied(self) -> None:
        if not self._applied:
            sys.stderr.write(
                "runtime.framework: the resumed script ended without reaching the DataLoader "
                "epoch that was in progress at the cut; its state was NOT restored. Refusing "
                "to report success.\n")
            sys.stderr.flush()
            os._exit(EXIT_NEVER_APPLIED)
