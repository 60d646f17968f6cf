"""examples/train_mlp.py under a witness that the control plane knows nothing of (bench/chaos_soak.py).

    soak_train.py --witness DIR [train_mlp.py's arguments]

Runs examples/train_mlp.py unchanged (same model, data, seeds: the same final parameters) and,
beside it, keeps an independent record of which copy of each rank ran, and from which step:

- DIR/rank<r>.lock: the copy holds an exclusive flock on it for as long as its process lives (the
  kernel drops it when the process dies, however it dies). A copy that finds the lock held by
  another live process is a second live copy of the same rank: a double run. It says so in its
  record (double: true) and trains on, so that the soak sees what the double run did.
- DIR/rank<r>.jsonl: one line per copy at its start (host, pid, time, the agent's job folder, generation).
- DIR/copy-<rank>-<pid>-<ns>.json: rewritten after every optimizer step: the first global step this copy took
  (Adam's own step count, restored by the framework engine, minus one: the step it resumed from)
  and the last one. The soak compares the first with the checkpoints the control plane accepted
  before this copy started: a copy that resumed from an older step lost an accepted checkpoint.
  It also counts `superseded_steps`: optimizer steps this copy took after a newer copy of its rank
  had started (a line in rank<r>.jsonl with a later start). That is the double run that matters
  when whole hosts freeze: a frozen copy keeps its flock while the control plane, rightly, restarts
  the job elsewhere (the frozen host cannot be told from a dead one), so the lock alone would call
  every such restart a double run; what must never happen is the thawed copy stepping on beside
  the new one (it must fence itself first: runtime/fence.py).

DIR lies on the store every host mounts (the emulated hosts share it, as a fleet shares NFS): the
flock and the records are seen from every host. Pids repeat across hosts' PID namespaces, so a copy
is named by (host, pid, start).
"""
import fcntl
import json
import os
import pathlib
import runpy
import socket
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
    record = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "double": False,
              "job_dir": os.environ.get("MERIDIAN_JOB_DIR"), "generation": os.environ.get("MERIDIAN_GENERATION")}
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        record["double"] = True
    with open(folder / f"rank{rank}.jsonl", "a") as log:
        log.write(json.dumps(record) + "\n")
    return record


def _newer_copy_started(folder, rank, mine):
    """Returns the first record of a copy of `rank` that started after `mine`, or None."""
    try:
        lines = (folder / f"rank{rank}.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            other = json.loads(line)
        except ValueError:
            continue  # a line being written
        if other.get("started", 0) > mine["started"] and (other.get("host"), other.get("pid")) != \
                (mine["host"], mine["pid"]):
            return other
    return None


def _step_recorder(folder, rank, mine):
    path = folder / f"copy-{rank}-{os.getpid()}-{time.time_ns()}.json"  # pids repeat across PID namespaces
    steps = {"superseded": 0, "superseded_by": None}

    def after_step(optimizer, _args, _kwargs):
        state = next((s for s in optimizer.state.values() if "step" in s), None)
        if state is None:
            return
        step = int(state["step"])
        steps.setdefault("first", step - 1)
        steps["last"] = step
        newer = _newer_copy_started(folder, rank, mine)
        if newer is not None:
            steps["superseded"] += 1
            steps["superseded_by"] = steps["superseded_by"] or {k: newer.get(k) for k in ("host", "pid", "started")}
        path.write_text(json.dumps({"rank": rank, "host": mine["host"], "pid": os.getpid(),
                                    "started": mine["started"], "resumed_from": steps["first"],
                                    "last_step": step, "at": time.time(), "superseded_steps": steps["superseded"],
                                    "superseded_by": steps["superseded_by"]}))

    return after_step


def main():
    folder, argv = _take_witness_argument(sys.argv[1:])
    rank = int(os.environ.get("RANK", "0"))
    mine = _witness_start(folder, rank)
    register_optimizer_step_post_hook(_step_recorder(folder, rank, mine))
    sys.argv = [str(TRAIN)] + argv
    runpy.run_path(str(TRAIN), run_name="__main__")


if __name__ == "__main__":
    main()
