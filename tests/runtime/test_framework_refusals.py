"""Framework engine refusals that need no second process: the tracker is installed in the test
process for one test and removed afterwards."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from runtime import framework

pytestmark = pytest.mark.runtime


@pytest.fixture
def tracker():
    installed = framework.install(rank=0, world_size=1)
    try:
        yield installed
    finally:
        installed._unpatch()


def _setup():
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    return model, optimizer, data


def _train_step(model, optimizer, x, y):
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def _two_steps(model, optimizer, loader):
    iterator = iter(loader)
    for _ in range(2):
        x, y = next(iterator)
        _train_step(model, optimizer, x, y)
    next(iterator)  # closes the second step's interval
    return iterator


def test_an_ordinary_loop_is_resumable_and_saves(tracker, tmp_path):
    model, optimizer, data = _setup()
    _two_steps(model, optimizer, DataLoader(data, batch_size=2, shuffle=True))
    tracker.check_resumable()
    rank_dir = tracker.save(tmp_path / "ck")
    assert rank_dir.name == "rank-0" and (rank_dir / "state.pt").is_file()
    assert tracker.step == 2
    seconds, device_bytes = tracker.last_save  # said in the checkpoint's event: nothing came from a GPU
    assert seconds > 0 and device_bytes == 0
    with pytest.raises(FileExistsError):
        tracker.save(tmp_path / "ck")


def test_the_bytes_a_save_copies_from_devices_count_each_storage_once():
    # The meta device stands in for a GPU here: a device other than the CPU, with no memory.
    weight = torch.empty(256, device="meta")  # 1 KiB
    state = {"tied": [weight, weight], "other": (torch.empty(64, device="meta"),),
             "host": torch.zeros(1000), "n": 3}
    assert framework._device_bytes(state) == 1024 + 256
    real = torch.zeros(100)  # a CPU storage shared by two entries: a save copies nothing from a device
    assert framework._device_bytes({"a": real, "b": real[:10]}) == 0


def test_install_twice_is_an_error(tracker):
    with pytest.raises(RuntimeError, match="already called"):
        framework.install(rank=0, world_size=1)


def _scaled_steps(model, optimizer, scaler, loader, *, new_scale=None):
    iterator = iter(loader)
    for _ in range(2):
        x, y = next(iterator)
        optimizer.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(optimizer)
        scaler.update(new_scale)
    next(iterator)  # closes the second step's interval


def test_a_grad_scaler_is_saved_as_its_update_after_the_cut_leaves_it(tracker, tmp_path):
    model, optimizer, data = _setup()
    disabled = torch.amp.GradScaler("cpu", enabled=False)  # kept as such  # noqa: F841
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    cuts = []
    tracker.add_step_listener(lambda step: step == 2 and cuts.append(tracker.save(tmp_path / "ck")))
    _scaled_steps(model, optimizer, scaler, DataLoader(data, batch_size=2))
    assert scaler.get_scale() == 32.0  # grown after each of the two steps
    saved = torch.load(cuts[0] / "state.pt", weights_only=True)["scalers"]
    assert [entry["enabled"] for entry in saved] == [False, True]
    # the cut came between step() and update(): saved is what update() made of it, not 16.0
    assert saved[1]["state"]["scale"] == 32.0 and saved[1]["state"]["_growth_tracker"] == 0


def test_a_scale_the_script_sets_itself_is_refused(tracker):
    """update(new_scale) after step() is not what the cut predicts: refused. (A script cannot skip
    update() or call it twice: torch itself raises.)"""
    model, optimizer, data = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    _scaled_steps(model, optimizer, scaler, DataLoader(data, batch_size=2), new_scale=4.0)
    with pytest.raises(framework.UnresumableScript, match="GradScaler's scale was not what its update"):
        tracker.check_resumable()


def test_persistent_workers_are_refused(tracker):
    _, _, data = _setup()
    DataLoader(data, batch_size=2, num_workers=1, persistent_workers=True)
    assert any("persistent_workers" in reason for reason in tracker._reasons)


def test_a_loader_subclass_that_overrides_iter_is_refused(tracker):
    class Mine(DataLoader):
        def __iter__(self):
            return super().__iter__()
    model, optimizer, data = _setup()
    Mine(data, batch_size=2)
    with pytest.raises(framework.UnresumableScript, match="Mine overrides __iter__"):
        tracker.check_resumable()


def test_two_loaders_mid_epoch_at_once_are_refused(tracker):
    model, optimizer, data = _setup()
    pairs = zip(DataLoader(data, batch_size=2), DataLoader(data, batch_size=2))
    for _ in range(3):
        (x, y), _ = next(pairs)
        _train_step(model, optimizer, x, y)
    with pytest.raises(framework.UnresumableScript, match="2 DataLoaders are in the middle"):
        tracker.check_resumable()


def test_an_abandoned_peek_does_not_count_as_a_busy_loader(tracker):
    model, optimizer, data = _setup()
    other = DataLoader(data, batch_size=4)
    next(iter(other))  # a peek at one batch: the iterator is gone at once
    _two_steps(model, optimizer, DataLoader(data, batch_size=2))
    tracker.check_resumable()


def test_nothing_to_resume_without_an_optimizer_or_a_loader(tracker):
    with pytest.raises(framework.UnresumableScript, match="no torch.optim optimizer"):
        tracker.check_resumable()
    model, optimizer, _ = _setup()
    _train_step(model, optimizer, torch.randn(2, 3), torch.randn(2, 1))
    with pytest.raises(framework.UnresumableScript, match="no batch has been fetched"):
        tracker.save("/nonexistent/never-written")


def test_hyper_parameters_changed_by_hand_after_step_are_refused(tracker):
    model, optimizer, data = _setup()
    iterator = iter(DataLoader(data, batch_size=2))
    for _ in range(2):
        x, y = next(iterator)
        _train_step(model, optimizer, x, y)
        optimizer.param_groups[0]["lr"] *= 0.5
    next(iterator)
    with pytest.raises(framework.UnresumableScript, match="hyper-parameters change"):
        tracker.check_resumable()


def test_listeners_run_after_each_step_in_order(tracker):
    calls = []
    tracker.add_step_listener(lambda step: calls.append(("a", step)))
    tracker.add_step_listener(lambda step: calls.append(("b", step)))
    model, optimizer, data = _setup()
    _two_steps(model, optimizer, DataLoader(data, batch_size=2))
    assert calls == [("a", 1), ("b", 1), ("a", 2), ("b", 2)]


def test_a_script_still_starting_is_not_named_uncuttable_before_it_trains():
    """A stop that arrives while a script is still starting (importing, building its model: a
    resumed follower host's ranks at a periodic checkpoint, in the multi-host e2e) must wait for
    the first step, not be refused as 'no torch.optim optimizer': that is said only once the
    script is seen training (a DataLoader iterated) without one."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from runtime.framework import FrameworkTracker, _LoaderRecord

    tracker = FrameworkTracker(rank=0, world_size=1)
    record = _LoaderRecord(0, DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2))
    tracker._loaders.append(record)
    assert tracker.no_cut_reason() is None  # built, not yet iterated: still starting
    record.epochs.append([1, False])  # its first epoch began, and no optimizer exists
    assert "no torch.optim optimizer" in tracker.no_cut_reason()


def _generators(*offsets):
    """CUDA generator states as torch saves them (seed, then Philox offset: 16 bytes), seed 42."""
    return [torch.tensor([42, offset], dtype=torch.int64).view(torch.uint8) for offset in offsets]


@pytest.mark.parametrize("saved, visible, refused", [(0, 0, False), (1, 1, False), (1, 2, False),
                                                     (2, 1, True), (1, 0, True)])
def test_cuda_generators_go_back_index_for_index_where_the_ranks_gpu_is_not_known(saved, visible, refused):
    # A launcher started by hand gives its ranks no GPU (the script picks one): no checkpoint says
    # which generator was the rank's, so all go back where they were and the rank must see them all.
    state = {"torch": torch.get_rng_state(), **({"cuda": _generators(*[8] * saved)} if saved else {})}
    placement, problem = framework._cuda_rng_placement(state, device=None, visible=visible)
    assert (problem is not None) == refused
    if refused:
        assert f"generators of {saved} device(s) and this rank sees {visible}" in problem
    else:
        assert list(placement) == list(range(saved))


def test_a_ranks_cuda_generator_follows_it_to_the_gpu_it_is_given_at_a_resume():
    """Issue 17: a GPU job's rank uses the GPU its launcher gives it (LOCAL_RANK), whose index can
    change between the cut and the resume (a resize: W = 4 on 4 GPUs shrunk to 2, rank 3 from cuda:3
    to cuda:1). torch restores generators by index: rank 3's dropout stream would have stayed on
    device 3 (not seen any more: refused before) and cuda:1 drawn from another's, not bit-exact."""
    saved = _generators(0, 0, 0, 24)  # only its own GPU (3) drew random numbers
    state = {"cuda": saved, "cuda_device": 3}
    placement, problem = framework._cuda_rng_placement(state, device=1, visible=2)
    assert problem is None and list(placement) == [1] and torch.equal(placement[1], saved[3])
    # kept its GPU on a host seeing fewer: its own back, the others (never drawn from) as seeded
    placement, problem = framework._cuda_rng_placement({"cuda": _generators(8, 0, 0), "cuda_device": 0},
                                                       device=0, visible=1)
    assert problem is None and list(placement) == [0]
    # kept its GPU and drew on another one it still sees: both go back where they were
    saved = _generators(8, 4)
    placement, problem = framework._cuda_rng_placement({"cuda": saved, "cuda_device": 0}, device=0, visible=2)
    assert problem is None and torch.equal(placement[1], saved[1])


@pytest.mark.parametrize("cuda_device, device, visible, said", [
    (0, 1, 2, "moved from CUDA device 0 to device 1 and had drawn random numbers on device 2"),
    (0, 0, 2, "drew random numbers on CUDA device 2 besides its own (device 0) and sees 2 device(s) now"),
    (5, 0, 2, "was device 5 of 3 at the cut"),
    (0, 2, 2, "is device 2 of the 2 it sees now"),
])
def test_a_cuda_generator_that_cannot_follow_the_rank_is_refused_by_name(cuda_device, device, visible, said):
    state = {"cuda": _generators(4, 0, 4), "cuda_device": cuda_device}
    placement, problem = framework._cuda_rng_placement(state, device=device, visible=visible)
    assert placement == {} and said in problem


def test_a_generator_state_of_an_unknown_layout_counts_as_drawn():
    assert framework._generator_drawn(_generators(4)[0]) and not framework._generator_drawn(_generators(0)[0])
    assert framework._generator_drawn(torch.zeros(8, dtype=torch.uint8))
    assert framework._generator_drawn(torch.zeros(16, dtype=torch.int64))
