"""What one job's world size W costs the control plane: submitting it (W Replica rows) and the
tick that places it (W rows rewritten), on the embedded SQLite database, per W.

Why W is bounded (issue 15, High 3): the cost grows with W, one Replica row per rank, and the
tick that places the job holds the database's write lock meanwhile. MERIDIAN_MAX_WORLD_SIZE (4096
by default) caps it; the W=100,000 row shows what a member could make the control plane do before.

Usage:
  .venv/bin/python bench/submit_world_size.py [--sizes 64,1024,4096,100000]
"""
import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64,1024,4096,100000")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    data_dir = tempfile.mkdtemp(prefix="meridian-bench-w-")
    os.environ["MERIDIAN_DATA_DIR"] = data_dir
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    os.environ.pop("DATABASE_URL", None)
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command
    from django.utils import timezone

    # the services push live updates on commit; no browser listens here
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    call_command("migrate", verbosity=0)
    from fleet.services import fleet_generate
    from jobs.demo_cast import cast_create
    from jobs.models import Job, Replica
    from jobs.services import job_cancel, job_submit
    from jobs.tick import tick_run

    settings.MERIDIAN_MAX_WORLD_SIZE = max(sizes)  # to measure past the default cap
    settings.MERIDIAN_MAX_RANKS_PER_DEVICE = max(sizes)
    settings.MERIDIAN_JOB_MAX_SPREAD = "node"
    cast = cast_create(quotas={"CPU": 1_000_000})
    fleet_generate(regions=1, clusters=1, nodes=4, devices=8, accelerator_type="CPU", prefix="bw")

    print(f"{'W':>8} {'submit s':>9} {'replica rows':>13} {'placing tick s':>15}  (SQLite, {data_dir})")
    now = timezone.now()
    for world_size in sizes:
        began = time.perf_counter()
        job = job_submit(team=cast.team_a, submitted_by=cast.alice, spec={
            "name": f"w{world_size}", "accelerator_type": "CPU", "world_size": world_size, "min_devices": 1,
            "entrypoint": "train.py"})
        submitted = time.perf_counter() - began
        rows = Replica.objects.filter(job=job).count()
        now += timedelta(seconds=10)
        began = time.perf_counter()
        tick_run(now=now)
        placed = time.perf_counter() - began
        state = Job.objects.get(pk=job.pk).state
        print(f"{world_size:>8,} {submitted:>9.3f} {rows:>13,} {placed:>15.3f}  ({state})")
        job_cancel(job=Job.objects.get(pk=job.pk), by=cast.alice)


if __name__ == "__main__":
    main()
