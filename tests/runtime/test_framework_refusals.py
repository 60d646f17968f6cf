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
    with pytest.raises(FileExistsError):
        tracker.save(tmp_path / "ck")


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


@pytest.mark.parametrize("saved, visible, refused", [(0, 0, False), (1, 1, False), (1, 2, False),
                                                     (2, 1, True), (1, 0, True)])
def test_cuda_generators_are_refused_where_the_rank_sees_fewer_devices(saved, visible, refused):
    state = {"rng": {"torch": torch.get_rng_state(),
                     **({"cuda": [torch.zeros(16, dtype=torch.uint8)] * saved} if saved else {})}}
    problem = framework._cuda_rng_problem(state, visible)
    assert (problem is not None) == refused
    if refused:
        assert f"generators of {saved} device(s) and this rank sees {visible}" in problem
