"""A job's script that looks at its /tmp and /dev/shm: writes a secret into both, lists them and
tries to read each path it is given. With several ranks, each also writes a file into /dev/shm,
all-reduces through torch.distributed (the runtime's virtual group) and then looks for its peers'
files, and says whether the reduction went through the shared-memory area (runtime/localreduce.py).
Writes $HOME/<name>-rank<r>.json (HOME is its workspace).

    private_dirs_probe.py NAME [--sleep S] [PATH ...]
"""
import json
import os
import sys
import tempfile
import time

name, rest = sys.argv[1], sys.argv[2:]
sleep_s = 0.0
if rest[:1] == ["--sleep"]:
    sleep_s, rest = float(rest[1]), rest[2:]
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
for folder in ("/tmp", "/dev/shm"):
    with open(os.path.join(folder, f"secret-{name}-rank{rank}"), "w") as handle:
        handle.write(f"{name} rank {rank}'s secret in {folder}")
report = {"tmpdir": os.environ.get("TMPDIR"), "gettempdir": tempfile.gettempdir()}
if world_size > 1:
    import torch
    import torch.distributed as dist

    from runtime import vpg
    dist.init_process_group("gloo")
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)  # every rank wrote its /dev/shm file before it got here
    report["allreduce"] = total.item()
    report["local_area"] = vpg.current_group().ensure_inner().local is not None
    dist.destroy_process_group()
reads = {}
for path in rest:
    try:
        with open(path, "rb") as handle:
            reads[path] = "read:" + handle.read(200).decode(errors="replace")
    except OSError as exc:
        reads[path] = f"refused:{exc.errno}"
report.update(reads=reads, tmp=sorted(os.listdir("/tmp")), shm=sorted(os.listdir("/dev/shm")),
              tmp_ids=[os.stat("/tmp").st_dev, os.stat("/tmp").st_ino],
              shm_ids=[os.stat("/dev/shm").st_dev, os.stat("/dev/shm").st_ino])
with open(os.path.join(os.environ["HOME"], f"{name}-rank{rank}.json"), "w") as handle:
    json.dump(report, handle)
time.sleep(sleep_s)
