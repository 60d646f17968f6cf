"""Live-update latency of the portal: from a change written to the database through the
services to the browser showing it, in real Chromium against uvicorn + Channels + Redis.

The portal is the browser tests' (tests/browser/browser_harness.py): a private database
(SQLite file, or a fresh PostgreSQL database when DATABASE_URL points at one), a private
redis-server (or REDIS_URL), uvicorn on a free port. Two measurements, --rounds each:

  job page    job_transition(...) of a job whose detail page is open → the state badge
              shows the new state (its data-rendered-at, the browser's Date.now() after
              the page refetched and redrew; same machine, same clock)
  fleet page  a job placed on 4 devices and started (one transaction, as the control
              loop applies a plan) → the fleet page's totals and heatmap redrawn

Each time runs from just before the service call (so it includes the database write and
commit) to the redraw: push over Redis, consumer, WebSocket, refetch, Plotly redraw.

Usage:
  .venv/bin/python bench/portal_live_latency.py [--rounds 20]
"""
import argparse
import os
import statistics
import time

from browser_bench import database_name, django_setup, logged_in_page, percentile

# The cycle a job page watches: every arrow is legal in jobs.services.TRANSITIONS.
CYCLE = ["running", "preempting", "preempted", "scheduled", "running", "migrating", "running", "resizing"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()

    data_dir = django_setup("meridian-latency-")  # noqa: F841 (removed at exit)
    from browser_harness import PortalServer, free_devices, place_job
    from playwright.sync_api import expect, sync_playwright

    def submit(name, world_size):
        from django.contrib.auth import get_user_model

        from jobs.models import Team
        from jobs.services import job_submit

        return job_submit(
            team=Team.objects.get(slug="team-a"), submitted_by=get_user_model().objects.get(username="alice"),
            spec={"name": name, "tier": "premium", "accelerator_type": "CPU", "world_size": world_size,
                  "min_devices": world_size, "entrypoint": "train.py"},
        ).pk

    def transition(job_id, to):
        from jobs.models import Job
        from jobs.services import job_transition

        job_transition(job=Job.objects.get(pk=job_id), to=to, reason="latency bench")

    def place(job_id, count):
        from jobs.models import Job

        place_job(Job.objects.get(pk=job_id), free_devices(count))

    def start_on_devices(job_id, count):
        from django.db import transaction

        with transaction.atomic():
            place(job_id, count)
            transition(job_id, "running")

    server = PortalServer().start()
    job_page_ms, fleet_page_ms = [], []
    try:
        with sync_playwright() as playwright:
            browser, page = logged_in_page(playwright, server, viewport={"width": 1400, "height": 1000},
                                           # wait_for_function evaluates its predicate with eval, which the
                                           # portal's CSP forbids; the pages' own scripts still run under it
                                           bypass_csp=True)

            # 1. job page
            job_id = server.call(submit, "latency-job", 2)
            server.call(place, job_id, 2)
            page.goto(f"/jobs/{job_id}/")
            page.wait_for_selector('body[data-live="subscribed"]', state="attached")
            badge = page.get_by_test_id("job-state")
            expect(badge).to_have_text("scheduled")
            for i in range(args.rounds):
                to = CYCLE[i % len(CYCLE)]
                started_ms = time.time() * 1000
                if to == "scheduled":
                    server.call(place, job_id, 2)  # back from the queue: placed anew, as the control loop does
                else:
                    server.call(transition, job_id, to)
                expect(badge).to_have_text(to)
                job_page_ms.append(int(badge.get_attribute("data-rendered-at")) - started_ms)
            # 2. fleet page
            page.goto("/")
            page.wait_for_selector('body[data-live="subscribed"]', state="attached")
            for i in range(args.rounds):
                allocated = page.evaluate("window.meridianFleet.data.totals.allocated")
                other = server.call(submit, f"latency-fleet-{i}", 4)
                started_ms = time.time() * 1000
                server.call(start_on_devices, other, 4)
                page.wait_for_function(f"window.meridianFleet.data.totals.allocated === {allocated + 4}")
                fleet_page_ms.append(int(page.evaluate("document.body.dataset.fleetRenderedAt")) - started_ms)
                server.call(transition, other, "cancelled")
                page.wait_for_function(f"window.meridianFleet.data.totals.allocated === {allocated}")
            browser.close()
    finally:
        server.stop()

    database = database_name()
    redis = "REDIS_URL" if os.environ.get("REDIS_URL") else "private redis-server (unix socket)"
    print(f"\nlive-update latency, event in database → browser redrawn ({database}, {redis}, uvicorn, Chromium)\n")
    print(f"{'page':<12} {'rounds':>6} {'min ms':>7} {'median ms':>10} {'p95 ms':>7} {'max ms':>7}")
    print("-" * 54)
    for label, values in (("job page", job_page_ms), ("fleet page", fleet_page_ms)):
        print(f"{label:<12} {len(values):>6} {min(values):>7.0f} {statistics.median(values):>10.0f} "
              f"{percentile(values, 0.95):>7.0f} {max(values):>7.0f}")


if __name__ == "__main__":
    main()
