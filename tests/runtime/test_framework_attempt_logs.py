"""A framework resume (or any new attempt) in the same job directory keeps every earlier
attempt's rank logs (logs/attempt-<n>/) instead of replacing them with the new attempt's files."""
import os
import types

from runtime import rank_logs
from runtime import spool as spool_files


def _launcher(tmp_path, spool_name):
    spool = tmp_path / spool_name
    for rank in range(2):
        spool_files.rank_dir(spool, rank).mkdir(parents=True)
    return types.SimpleNamespace(job_dir=tmp_path / "job", spool=spool, world_size=2)


def _attempt(tmp_path, n):
    launcher = _launcher(tmp_path, f"spool-{n}")
    rank_logs.link(launcher)
    for rank in range(2):
        with open(rank_logs.spool_log_path(launcher.spool, rank), "a") as out:
            out.write(f"attempt {n} rank {rank}\n")
    return launcher


def test_each_attempt_keeps_the_logs_of_the_ones_before(tmp_path):
    for n in (1, 2, 3):
        _attempt(tmp_path, n)
    logs = tmp_path / "job" / "logs"
    assert (logs / "rank1.log").read_text() == "attempt 3 rank 1\n"
    assert (logs / "attempt-1" / "rank0.log").read_text() == "attempt 1 rank 0\n"
    assert (logs / "attempt-2" / "rank1.log").read_text() == "attempt 2 rank 1\n"
    assert sorted(os.listdir(logs / "attempt-1")) == ["rank0.err", "rank0.log", "rank1.err", "rank1.log"]
    assert not (logs / "attempt-3").exists()


def test_linking_the_same_attempt_again_moves_nothing(tmp_path):
    launcher = _attempt(tmp_path, 1)
    rank_logs.link(launcher)  # e.g. put_back then link: same spool files, same inodes
    logs = tmp_path / "job" / "logs"
    assert not (logs / "attempt-1").exists()
    assert (logs / "rank0.log").read_text() == "attempt 1 rank 0\n"
