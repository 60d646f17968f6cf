"""A job's script that tries the network: with several ranks it first all-reduces through
torch.distributed (the runtime's virtual group: gloo and the launcher's rendezvous store, over
loopback), then tries a TCP connection to each HOST:PORT it is given. Writes
$HOME/<name>-rank<r>.json: the reduction's result, the network namespace it runs in, the interfaces
it sees, and per address "connected" or "refused:<errno>"; prints it too, as a line "PROBE <json>".

    network_probe.py NAME [HOST:PORT ...]
"""
import json
import os
import socket
import sys

name, targets = sys.argv[1], sys.argv[2:]
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
report = {"netns": os.readlink("/proc/self/ns/net"), "interfaces": sorted(n for _, n in socket.if_nameindex())}
if world_size > 1:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    report["allreduce"] = total.item()
    dist.destroy_process_group()
reaches = {}
for target in targets:
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        reaches[target] = "connected"
    except OSError as exc:
        reaches[target] = f"refused:{exc.errno}"
report["reaches"] = reaches
with open(os.path.join(os.environ["HOME"], f"{name}-rank{rank}.json"), "w") as handle:
    json.dump(report, handle)
print("PROBE " + json.dumps(report), flush=True)  # also in the rank's log, which outlives its HOME
