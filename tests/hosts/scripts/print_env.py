"""Writes this rank's torchrun-style environment and one cross-host all-reduce to OUT/rank<r>.txt."""
import os
import socket
import sys

import torch
import torch.distributed as dist

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
dist.destroy_process_group()
