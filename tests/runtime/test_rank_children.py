"""A rank that ends with os._exit (a stop at a cut, a refused resume, its launcher gone) ends its
DataLoader workers with it (runtime.exits.end_children): without that, a worker that is busy (or
caught in a lock at fork) outlives the rank, holding its memory and its output pipes."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.runtime

SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, sys.argv[1])
    import torch
    from torch.utils.data import DataLoader, Dataset
    from runtime import exits

    class Slow(Dataset):  # item 0 comes at once; the next ones keep their worker busy for good
        def __len__(self):
            return 64
        def __getitem__(self, i):
            if i > 0:
                time.sleep(3600)
            return torch.zeros(2)

    it = iter(DataLoader(Slow(), batch_size=1, num_workers=2))
    next(it)
    pids = [w.pid for w in it._workers]
    print(" ".join(map(str, pids)), flush=True)
    if sys.argv[2] == "end":
        print(exits.end_children(), flush=True)
    os._exit(0)
""")


def test_a_rank_ending_with_os_exit_takes_its_busy_dataloader_workers_with_it(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    # The pipes close only when every process holding them is gone: the workers too.
    done = subprocess.run([sys.executable, str(script), str(REPO), "end"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    pids, ended = done.stdout.split("\n")[:2]
    assert int(ended) == 2
    for pid in map(int, pids.split()):
        assert not os.path.exists(f"/proc/{pid}") or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_without_ending_them_the_busy_workers_outlive_the_rank(tmp_path):
    """The control: the same rank without end_children leaves its workers holding its pipes."""
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    process = subprocess.Popen([sys.executable, str(script), str(REPO), "keep"], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    try:
        pids = [int(p) for p in process.stdout.readline().split()]
        assert process.wait(timeout=120) == 0
        with pytest.raises(subprocess.TimeoutExpired):
            process.communicate(timeout=8)  # past the workers' 5 s watchdog: still busy, still there
        assert all(os.path.exists(f"/proc/{pid}") for pid in pids)
    finally:
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        process.communicate(timeout=30)
