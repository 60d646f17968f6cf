"""One rank of tests/runtime/test_vpg.py's determinism check: all-reduces order-sensitive float32
values through the virtual group after a skewed, seeded delay, pinned to the cores it is given.

Usage: vpg_reduce_probe.py RANK WORLD PORT CORES(comma list) DELAY_SEED OUT [DEVICE]
With DEVICE (this rank's job-wide device number) the group folds the ranks of each device
(runtime/fold.py): transport "fold", and the report says how large the members' group is.
Writes the reduced tensor's bytes (hex; 3 repeats, then the same values shifted by 37,000 positions),
which transport carried them ("local": one shared area, "hosts": the chain across hosts' areas,
"gloo"), the gloo operations the all-reduce that carried the cut's flags issued, and the sockets
and shared mappings left after closing the virtual group. MERIDIAN_VPG_LOCAL=0 forces gloo;
MERIDIAN_VPG_SHM_DIR set per rank makes ranks with different directories different "hosts"."""
import collections
import datetime
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))
from runtime import localreduce, vpg  # noqa: E402


class CountingGroup:
    """Forwards to a gloo group, counting the operations issued on it by name."""

    def __init__(self, pg):
        self.pg = pg
        self.counts = collections.Counter()

    def __getattr__(self, name):
        attribute = getattr(self.pg, name)
        if not callable(attribute):
            return attribute

        def counted(*args, **kwargs):
            self.counts[name] += 1
            return attribute(*args, **kwargs)
        return counted


def main():
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    cores = [int(c) for c in sys.argv[4].split(",")]
    delays = random.Random(int(sys.argv[5]) * 100 + rank)
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(1)

    device = int(sys.argv[7]) if len(sys.argv) > 7 else None

    def connect():
        return vpg.InnerGroup(rank=rank, world_size=world, master_addr="127.0.0.1",
                              master_port=port, key_prefix="probe",
                              timeout=datetime.timedelta(seconds=60),
                              device=device, fold=device is not None)
    group = vpg.VirtualProcessGroup(rank, world, connect, vpg.CollectiveHooks())
    # Magnitudes from 1e-3 to 1e8 with alternating signs: float32 sums of these depend on order.
    def values_of(r):
        generator = torch.Generator().manual_seed(r)
        return torch.randn(100_003, generator=generator) * torch.logspace(-3, 8, 100_003)
    values = values_of(rank)
    # What a left-to-right sum in rank order gives (W = 2: either order, addition commutes).
    expected = values_of(0).clone()
    for r in range(1, world):
        expected.add_(values_of(r))
    results = []
    for repeat in range(3):
        time.sleep(delays.uniform(0, 0.05))
        tensor = values.clone()
        if repeat == 1:  # the cut's flags ride along with an all-reduce
            inner = group.ensure_inner()
            counting = CountingGroup(inner.pg)
            inner.pg = counting
            chain = inner.host_chain
            folded = chain is not None and chain.plan is not None
            # A folded chain's messages go over the members' group, not the W-rank group.
            chain_counting = CountingGroup(chain.pg) if folded and chain.pg is not None else counting
            if chain is not None and (not folded or chain.pg is not None):
                chain.pg = chain_counting
            vpg.send_flags_with_next_allreduce([rank, 1])
        group.allreduce([tensor]).wait()
        if repeat == 1:
            flags = vpg.take_carried_flags()
            inner.pg = counting.pg
            if chain is not None and (not folded or chain.pg is not None):
                chain.pg = chain_counting.pg
            issued = dict(counting.counts)
            members_issued = dict(chain_counting.counts) if chain_counting is not counting else {}
            del counting, chain_counting
        results.append(tensor.numpy().tobytes().hex())
    # The same values at other positions (as when DDP lays its buckets out anew): each element
    # must come out the same wherever it sits.
    shifted = torch.cat([values[37_000:], values[:37_000]])
    group.allreduce([shifted]).wait()
    unshifted = torch.cat([shifted[-37_000:], shifted[:-37_000]])
    results.append(unshifted.numpy().tobytes().hex())
    # A size W divides (the all-gather then lands straight in the tensor) must be right too.
    even = values[:100_000].clone()
    group.allreduce([even]).wait()
    rank_order = bool(torch.equal(tensor, expected) and torch.equal(even, expected[:100_000]))
    chain = group.inner.host_chain
    transport = ("local" if group.inner.local is not None
                 else "fold" if chain is not None and chain.plan is not None
                 else "hosts" if chain is not None else "gloo")
    members_group_size = chain.pg.size() if transport == "fold" and chain.pg is not None else None
    del chain
    group.close_inner()
    with open(sys.argv[6], "w") as handle:
        json.dump({"results": results, "rank_order": rank_order, "transport": transport,
                   "flags": flags, "issued": issued, "members_issued": members_issued,
                   "members_group_size": members_group_size,
                   "sockets": len(vpg.open_socket_fds()),
                   "mappings": len(localreduce.shared_mappings())}, handle)


if __name__ == "__main__":
    main()
