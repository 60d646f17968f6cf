"""What writers killed mid-checkpoint leave in a store (a `.staging-*` or `.tmp-*` folder) is
swept once idle, and a writer that was only frozen fails cleanly when it comes back: its
commit finds nothing, and neither engine recreates the folder (issue 14: a leader killed
mid-checkpoint left its staging folder, a whole checkpoint's bytes, for good)."""
import os
import time

import pytest

from runtime import criu, framework
from runtime.store import STAGING_PREFIX, TMP_PREFIX, CheckpointError, CheckpointStore

HOUR = 3600.0


@pytest.fixture
def store(tmp_path):
    return CheckpointStore(tmp_path / "store", keep=3)


def _age(path, seconds):
    """Sets the mtime of `path` and of everything beneath it `seconds` in the past."""
    then = time.time() - seconds
    for folder, dirs, files in os.walk(path):
        for name in dirs + files:
            os.utime(os.path.join(folder, name), (then, then))
    os.utime(path, (then, then))


def _staging_with(store, files):
    staging = store.staging_dir()
    for rel, payload in files.items():
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(payload)
    return staging


def test_an_idle_staging_folder_is_swept_and_a_live_one_and_the_checkpoints_are_kept(store, tmp_path):
    source = tmp_path / "dump"
    source.mkdir()
    (source / "a.bin").write_bytes(b"a" * 10)
    ref = store.commit(source, step=3, engine="framework")
    abandoned = _staging_with(store, {"node0/rank0/pages-1.img": b"x" * 1000, "node1/rank1.img": b"y" * 24})
    _age(abandoned, 2 * HOUR)
    live = _staging_with(store, {"rank-0/state.pt": b"z" * 10})
    _age(live, 2 * HOUR)
    (live / "rank-0" / "state.pt").write_bytes(b"z" * 11)  # one file written just now: its writer is alive
    half_commit = store.root / f"{TMP_PREFIX}ckpt-000000000004-1"
    half_commit.mkdir()
    (half_commit / "f").write_bytes(b"q" * 5)
    _age(half_commit, 2 * HOUR)

    removed = store.sweep_abandoned(idle_s=HOUR)

    assert sorted(removed) == sorted([(abandoned.name, 1024), (half_commit.name, 5)])
    assert not abandoned.exists() and not half_commit.exists() and live.is_dir()
    assert sorted(os.listdir(store.root)) == sorted([live.name, os.path.basename(ref.uri)])
    assert [r.step for r in store.list()] == [3]
    assert store.sweep_abandoned(idle_s=HOUR) == []  # nothing more


def test_keep_alive_keeps_a_checkpoint_that_only_waits_for_its_cut(store):
    staging = store.staging_dir()
    _age(staging, 2 * HOUR)
    with store.keep_alive(staging, every_s=0.05):
        time.sleep(0.3)
        assert store.sweep_abandoned(idle_s=HOUR) == []
    assert staging.is_dir()


def test_a_writer_that_comes_back_after_the_sweep_commits_nothing(store):
    staging = _staging_with(store, {"rank-0/state.pt": b"s" * 100})
    _age(staging, 2 * HOUR)
    assert store.sweep_abandoned(idle_s=HOUR) == [(staging.name, 100)]
    with pytest.raises((CheckpointError, OSError)):
        store.commit(staging, step=9, engine="framework")
    assert store.list() == [] and not staging.exists()


def test_the_engines_never_recreate_a_swept_staging_folder(store, tmp_path):
    gone = store.root / f"{STAGING_PREFIX}0123456789abcdef"
    tracker = framework.FrameworkTracker(rank=0, world_size=1)
    with pytest.raises(FileNotFoundError, match="staging folder .* is gone"):
        tracker.save(gone)
    with pytest.raises(FileNotFoundError):  # before CRIU runs at all
        criu.dump(os.getpid(), gone / "rank0", leave_running=True)
    assert not gone.exists()


def test_a_sweep_interrupted_after_its_rename_is_finished_by_the_next_one(store):
    staging = _staging_with(store, {"x": b"1"})
    leftover = store.root / f".swept-{staging.name.lstrip('.')}-deadbeef"
    os.rename(staging, leftover)  # a sweep killed between its rename and its removal
    assert store.sweep_abandoned(idle_s=HOUR) == [(leftover.name, 1)]
    assert not leftover.exists()


@pytest.mark.runtime
def test_a_launcher_sweeps_what_a_killed_writer_left_in_its_store(tmp_path, jobs):
    """The wiring: meridian-run, the store's committer, sweeps at start (a killed leader's
    staging folder, as tests/hosts/test_multihost_killed_mid_checkpoint.py leaves it)."""
    from runtime_helpers import DDP_SCRIPT, Job, unique_id
    store = CheckpointStore(tmp_path / "store")
    abandoned = _staging_with(store, {"node0/rank0/pages-1.img": b"p" * 4096})
    _age(abandoned, 2 * HOUR)
    fresh = _staging_with(store, {"node1/rank1/pages-1.img": b"p" * 10})
    job = Job(tmp_path / "node", ranks=2, script=DDP_SCRIPT, out=tmp_path / "out.pt",
              script_args=["--epochs", "100000", "--step-sleep", "0.02"], engine="framework",
              job_id=unique_id("sweep"), store=tmp_path / "store")
    jobs.append(job)
    job.wait_ready()
    deadline = time.monotonic() + 30
    while abandoned.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not abandoned.exists(), "the launcher did not sweep the abandoned staging folder"
    assert fresh.is_dir()
