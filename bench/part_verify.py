"""What one host reads to check a CRIU checkpoint spanning hosts before it restores its part.

    python bench/part_verify.py [--hosts 2 4 8] [--part-mb 128] [--repeat 3]

Builds, in a temporary store, a checkpoint laid out as runtime/criu_parts.py lays one out (one
folder node<k> per host, `--part-mb` MB of page images each, plus a small shared file), then
times, for host 1 of N, `CheckpointStore.pinned` (the launcher's check at a resume: the manifest
pinned to its digest, then the files) two ways: checking every file (what every host did before
session 13) and checking the files outside every part plus its own part only (what it does now:
CheckpointStore.skip_parts_of: the other hosts' parts). Each timing uses a fresh store (no
per-process cache). Prints a table: the bytes checked and the median seconds, and their ratio.
The page cache is warm after the first pass (the files were just written): the figures are
hashing time, a lower bound on what a shared file system's reads add.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from runtime.criu_parts import other_parts, part_dir  # noqa: E402
from runtime.store import CheckpointStore, manifest_sha256  # noqa: E402


def build(root: pathlib.Path, hosts: int, part_mb: int):
    source = root / "source"
    for node in range(hosts):
        rank_dir = part_dir(source, node) / f"rank{node}"
        rank_dir.mkdir(parents=True)
        with open(rank_dir / "pages-1.img", "wb") as handle:
            for _ in range(part_mb):
                handle.write(os.urandom(1 << 20))
    (source / "workspace").mkdir()
    (source / "workspace" / "out.txt").write_bytes(b"shared by every host\n")
    ref = CheckpointStore(root / "store").commit(source, step=1, engine="criu", meta={"nodes": hosts})
    return ref, manifest_sha256(ref.path)


def timed(root, digest, skip, repeat):
    seconds = []
    for _ in range(repeat):
        store = CheckpointStore(root / "store")
        store.skip_parts_of = lambda _meta: skip
        began = time.perf_counter()
        store.pinned(digest)
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--part-mb", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"{'hosts':>5} {'checked before (MB)':>20} {'now (MB)':>9} {'before (s)':>11} {'now (s)':>8} {'ratio':>6}")
    for hosts in args.hosts:
        with tempfile.TemporaryDirectory(prefix="part-verify-") as tmp:
            root = pathlib.Path(tmp)
            _ref, digest = build(root, hosts, args.part_mb)
            every = timed(root, digest, frozenset(), args.repeat)
            own = timed(root, digest, other_parts(nodes=hosts, node_rank=1), args.repeat)
            print(f"{hosts:>5} {hosts * args.part_mb:>20} {args.part_mb:>9} {every:>11.3f} {own:>8.3f} "
                  f"{own / every:>6.2f}")


if __name__ == "__main__":
    main()
