"""examples/train_mlp.py under a witness that the control plane knows nothing of (bench/chaos_soak.py).

    soak_train.py --witness DIR [train_mlp.py's arguments]

Runs examples/train_mlp.py unchanged (same model, data, seeds: the same final parameters) and,
beside it, keeps an independent record of which copy of each rank ran, and from which step:

- DIR/rank<r>.lock: the copy holds an exclusive flock on it for as long as its process lives (the
  kernel drops it when the process dies, however it dies). A copy that finds the lock held by
  another live process is a second live copy of the same rank: a double run. It says so in its
  record (double: true) and trains on, so that the soak sees what the double run did.
- DIR/rank<r>.jsonl: one line per copy at its start (pid, time, the agent's job folder, generation).
- DIR/copy-<rank>-<pid>-<ns>.json: rewritten after every optimizer step: the first global step this copy took
  (Adam's own step count, restored by the framework engine, minus one: the step it resumed from)
  and the last one. The soak compares the first with the checkpoints the control plane accepted
  before this copy started: a copy that resumed from an older step lost an accepted checkpoint.
"""
import fcntl
import json
import os
import pathlib
import runpy
import sys
import time

from torch.optim.optimizer import register_optimizer_step_post_hook

TRAIN = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_mlp.py"
_held = []  # the lock file, referenced for the process's life (closing it would drop the flock)


def _take_witness_argument(argv):
    """Returns (witness folder, argv without --witness DIR)."""
    index = argv.index("--witness")
    return pathlib.Path(argv[index + 1]), argv[:index] + argv[index + 2:]


def _witness_start(folder, rank):
    folder.mkdir(parents=True, exist_ok=True)
    lock = open(folder / f"rank{rank}.lock", "a")
    _held.append(lock)
    record = {"rank": rank, "pid": os.getpid(), "started": time.time(), "double": False,
              "job_dir": os.environ.get("MERIDIAN_JOB_DIR"), "generation": os.environ.get("MERIDIAN_GENERATION")}
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        record["double"] = True
    with open(folder / f"rank{rank}.jsonl", "a") as log:
        log.write(json.dumps(record) + "\n")


def _step_recorder(folder, rank):
    path = folder / f"copy-{rank}-{os.getpid()}-{time.time_ns()}.json"  # pids repeat across PID namespaces
    steps = {}

    def after_step(optimizer, _args, _kwargs):
        state = next((s for s in optimizer.state.values() if "step" in s), None)
        if state is None:
            return
        step = int(state["step"])
        steps.setdefault("first", step - 1)
        steps["last"] = step
        path.write_text(json.dumps({"rank": rank, "pid": os.getpid(), "resumed_from": steps["first"],
                                    "last_step": step, "at": time.time()}))

    return after_step


def main():
    folder, argv = _take_witness_argument(sys.argv[1:])
    rank = int(os.environ.get("RANK", "0"))
    _witness_start(folder, rank)
    register_optimizer_step_post_hook(_step_recorder(folder, rank))
    sys.argv = [str(TRAIN)] + argv
    runpy.run_path(str(TRAIN), run_name="__main__")


if __name__ == "__main__":
    main()
