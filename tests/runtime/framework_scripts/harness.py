"""Runs a script the way runtime/rank.py does (framework.install, then the unmodified script),
for tests that do not need the launcher. Environment:
  RANK, WORLD_SIZE            as torchrun sets them (default 0 / 1)
  MERIDIAN_RESUME             framework checkpoint folder to resume from
  TEST_CUT_STEP, TEST_SAVE_DIR   save at this step into that folder, then die like a
                               preempted process (os._exit, no cleanup)
  TEST_CUT_CONTINUE           with TEST_CUT_STEP: save, then go on to the end (no preemption)
  TEST_STEP_FILE              where to write tracker.step (and no_cut_reason()) when the
                              script ends
Usage: python harness.py script.py args...
Exit 0 after a cut; 3 with 'UNRESUMABLE: reason' on stderr when the engine refuses."""
import atexit
import json
import os
import runpy
import sys

sys.path.insert(0, os.environ["TEST_REPO_ROOT"])
from runtime import exits, framework  # noqa: E402

try:
    tracker = framework.install(rank=int(os.environ.get("RANK", "0")),
                                world_size=int(os.environ.get("WORLD_SIZE", "1")),
                                resume_dir=os.environ.get("MERIDIAN_RESUME"))
except framework.UnresumableScript as exc:
    sys.stderr.write(f"UNRESUMABLE: {exc.reason}\n")
    sys.stderr.flush()
    os._exit(3)

cut_step = int(os.environ.get("TEST_CUT_STEP", "0"))


def preempt_at_cut(step):
    if step != cut_step:
        return
    try:
        tracker.save(os.environ["TEST_SAVE_DIR"])
    except framework.UnresumableScript as exc:
        sys.stderr.write(f"UNRESUMABLE: {exc.reason}\n")
        sys.stderr.flush()
        os._exit(3)
    if os.environ.get("TEST_CUT_CONTINUE"):
        return  # a checkpoint the run goes on from (its end is the reference of an unseeded script)
    sys.stdout.flush()
    sys.stderr.flush()
    exits.end_children()  # as the engine's stop does: DataLoader workers end with the rank
    os._exit(0)


tracker.add_step_listener(preempt_at_cut)
script = sys.argv[1]
sys.argv = sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
except framework.UnresumableScript as exc:
    sys.stderr.write(f"UNRESUMABLE: {exc.reason}\n")
    sys.stderr.flush()
    os._exit(3)
if os.environ.get("TEST_STEP_FILE"):
    with open(os.environ["TEST_STEP_FILE"], "w") as f:
        json.dump({"step": tracker.step, "no_cut_reason": tracker.no_cut_reason()}, f)
# The script's work is done and written. Leave without interpreter teardown: a two-rank gloo DDP
# script (ddp_train.py, plain torch.distributed, no virtual group) sometimes aborts in torch's C++
# destructors after destroy_process_group ("terminate called without an active exception", rank 0,
# no Python frame): 4 of 16 resumed runs on e4141ab, 1 of 8 here, measured with the two ranks run
# by hand. That is torch's teardown, not the state under test, and the tests then failed at random.
# The exit handlers still run first: the tracker's refuses a resume that was never applied (75).
atexit._run_exitfuncs()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
