"""examples/train_mlp.py with a file held open in the job's private /tmp and one in its /dev/shm for
the whole run: each rank opens /tmp/steps-rank<r>.txt and /dev/shm/steps-rank<r>.txt once, appends a
line per optimizer step, and at the end writes how many lines each holds (read back by path) to
<--out>.held-rank<r>.json. A CRIU checkpoint must carry both files (their contents and the open
descriptors) for the counts to equal an uninterrupted run's. Each rank also leaves a stale unix
socket file, /tmp/stale-rank<r>.sock (bound, then closed), which a checkpoint cannot carry and must
say it left out (runtime/private_dirs.py save_into).

    train_holding_tmp.py --out PATH [train_mlp.py's other arguments]
"""
import json
import os
import pathlib
import runpy
import socket
import sys

from torch.optim.optimizer import register_optimizer_step_post_hook

TRAIN = pathlib.Path(__file__).resolve().parents[3] / "examples" / "train_mlp.py"
out = sys.argv[sys.argv.index("--out") + 1]
rank = os.environ.get("RANK", "0")
stale = socket.socket(socket.AF_UNIX)
stale.bind(f"/tmp/stale-rank{rank}.sock")
stale.close()  # the file stays
held = {path: open(path, "a", buffering=1) for path in (f"/tmp/steps-rank{rank}.txt", f"/dev/shm/steps-rank{rank}.txt")}


def note_step(optimizer, args, kwargs):
    for handle in held.values():
        handle.write("step\n")


register_optimizer_step_post_hook(note_step)
sys.argv = [str(TRAIN), *sys.argv[1:]]
runpy.run_path(str(TRAIN), run_name="__main__")
counts = {path: pathlib.Path(path).read_text().count("step\n") for path in held}
pathlib.Path(f"{out}.held-rank{rank}.json").write_text(json.dumps(counts))
