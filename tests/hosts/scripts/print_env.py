"""Writes this rank's torchrun-style environment, one cross-host all-reduce and the transport the
virtual group reduces through (runtime/vpg.py: local, hosts or gloo) to OUT/rank<r>.txt."""
import os
import socket
import sys

import torch
import torch.distributed as dist

from runtime import vpg

dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank())])
dist.all_reduce(value)
os.makedirs(sys.argv[1], exist_ok=True)
names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
         "MERIDIAN_NODE_ADDR")
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.txt"), "w") as handle:
    for name in names:
        handle.write(f"{name}={os.environ[name]}\n")
    handle.write(f"hostname={socket.gethostname()}\nallreduce={value.item()}\n")
    inner = vpg.current_group().inner
    handle.write("transport=" + ("local" if inner.local is not None
                                 else "hosts" if inner.host_chain is not None else "gloo") + "\n")
dist.destroy_process_group()
