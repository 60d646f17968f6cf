"""The portal in real Chromium (Playwright) against uvicorn + Channels + Redis.

Changes are driven through the same services the control loop calls (job_transition,
preemption_request_create, ...), from this process on the server's database; the pages
must show them without a reload. Polling is Playwright's expect / wait_for_* with
deadlines, never fixed sleeps. Cast: alice (team A member), charlie (team B member),
carol (capacity manager of A and B).
"""
import json
import re
import time
import uuid

import pytest
from browser_harness import artifacts_dir, free_devices, place_job
from playwright.sync_api import expect
from polling import poll

pytestmark = pytest.mark.browser


def unique(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def wait_for(page, expression, arg=None, timeout=30):
    """Waits until `expression` (a JavaScript expression, or a function of `arg`) is truthy in the
    page. Not page.wait_for_function: its polling compiles the predicate inside the page, which the
    portal's Content-Security-Policy (script-src 'self', no 'unsafe-eval') refuses; page.evaluate
    goes through the DevTools protocol, which the policy does not govern."""
    poll(f"the page to satisfy {expression[:80]}", lambda: page.evaluate(expression, arg), timeout=timeout)


def wait_live(page):
    """Waits until the page's socket has joined its groups (pushes from now on arrive)."""
    page.wait_for_selector('body[data-live="subscribed"]', state="attached")


def submit_as_alice(spec):
    from django.contrib.auth import get_user_model

    from jobs.models import Team
    from jobs.services import job_submit

    alice = get_user_model().objects.get(username="alice")
    return job_submit(
        team=Team.objects.get(slug="team-a"),
        submitted_by=alice,
        spec={"entrypoint": "train.py", "accelerator_type": "CPU", **spec},
    )


def transition(job_id, to, reason=""):
    from jobs.models import Job
    from jobs.services import job_transition

    return job_transition(job=Job.objects.get(pk=job_id), to=to, reason=reason)


def place(job_id, devices):
    from jobs.models import Job

    return place_job(Job.objects.get(pk=job_id), free_devices(devices))


def test_a_submitter_submits_a_job_and_watches_it_appear_and_its_timeline_change_live(login, on_server):
    jobs_page = login("alice")
    jobs_page.goto("/jobs/")
    wait_live(jobs_page)

    form = jobs_page.context.new_page()
    form.goto("/jobs/submit/")
    name = unique("browser-submit")
    form.fill("#id_name", name)
    form.fill("#id_entrypoint", "train.py")
    form.fill("#id_args", "--epochs 1")
    form.fill("#id_world_size", "4")
    form.fill("#id_min_devices", "3")  # does not divide 4: the service says so at the field
    form.select_option("#id_tier", "premium")
    form.select_option("#id_accelerator_type", "CPU")
    form.get_by_test_id("submit").click()
    expect(form.get_by_test_id("error-min_devices")).to_contain_text("must divide world_size 4")

    form.fill("#id_min_devices", "2")
    form.get_by_test_id("submit").click()
    form.wait_for_url(re.compile(r"/jobs/\d+/$"))
    job_id = int(form.url.rstrip("/").rsplit("/", 1)[1])
    expect(form.get_by_test_id("job-state")).to_have_text("pending")
    expect(form.get_by_test_id("queue-position")).to_be_visible()

    # The other tab, open before the job existed, shows it without a reload.
    row = jobs_page.locator(f'tr[data-job-id="{job_id}"]')
    expect(row).to_contain_text(name)
    expect(row.locator(".state")).to_have_text("pending")

    wait_live(form)
    on_server(place, job_id, 2)
    expect(form.get_by_test_id("job-state")).to_have_text("scheduled")
    wait_for(form, "window.meridianJob.data.timeline.segments.some(s => s.lane === 'placement')")

    started_ms = time.time() * 1000
    on_server(transition, job_id, "running", "ranks started")
    expect(form.get_by_test_id("job-state")).to_have_text("running")
    latency_ms = int(form.get_by_test_id("job-state").get_attribute("data-rendered-at")) - started_ms
    expect(row.locator(".state")).to_have_text("running")
    labels = form.evaluate("window.meridianJob.data.timeline.segments.map(s => s.lane + ':' + s.label)")
    assert [label for label in labels if label.startswith("state:")] == [
        "state:pending", "state:scheduled", "state:running"
    ]
    expect(form.locator('#job-events tr[data-event-type="state_changed"]')).to_have_count(2)
    form.screenshot(path=str(artifacts_dir() / "job.png"), full_page=True)

    on_server(transition, job_id, "cancelled", "test done")
    expect(form.get_by_test_id("job-state")).to_have_text("cancelled")
    (artifacts_dir() / "live_latency_submit_test.json").write_text(json.dumps({"db_to_browser_ms": latency_ms}))
    print(f"\nevent in database → job page updated: {latency_ms:.0f} ms")


def test_a_capacity_manager_approves_a_preemption_and_sees_the_job_move(login, on_server):
    carol = login("carol")
    carol.goto("/approvals/")
    wait_live(carol)

    name = unique("victim")

    def running_job_with_a_preemption_request():
        from jobs.models import Job
        from jobs.services import job_transition, preemption_request_create

        job = submit_as_alice({"name": name, "tier": "standard", "world_size": 4, "min_devices": 4})
        job = job_transition(job=place_job(job, free_devices(4)), to="running")
        Job.objects.filter(pk=job.pk).update(
            progress_step=900, last_checkpoint_step=600, attained_device_seconds=60, ideal_device_seconds=100
        )
        request = preemption_request_create(
            job=job, reason="a premium job needs 4 CPU devices", lost_work_seconds=480.0
        )
        return job.pk, request.pk

    job_id, request_id = on_server(running_job_with_a_preemption_request)

    # The request appears without a reload, with its blast radius.
    pending = carol.locator(f'#pending-table tr[data-request-id="{request_id}"]')
    expect(pending).to_contain_text(name)
    expect(pending).to_contain_text("Standard")
    expect(pending).to_contain_text("4 CPU")
    expect(pending).to_contain_text("480 device-s (300 steps)")
    expect(pending).to_contain_text("0.600")

    carol.screenshot(path=str(artifacts_dir() / "approvals.png"), full_page=True)
    pending.locator("textarea[name=note]").fill("approved for the premium launch")
    pending.get_by_test_id("approve").click()
    trail = carol.locator(f'#trail-table tr[data-request-id="{request_id}"]')
    expect(trail).to_contain_text("approved")
    expect(trail).to_contain_text("approved for the premium launch")
    expect(trail.get_by_test_id("trail-job-state")).to_have_text("running")
    wait_live(carol)

    # The control loop acts on the approval: checkpoint at a consistent cut, release.
    on_server(transition, job_id, "preempting", "approved preemption")
    expect(trail.get_by_test_id("trail-job-state")).to_have_text("preempting")
    on_server(transition, job_id, "preempted", "checkpointed at step 900")
    expect(trail.get_by_test_id("trail-job-state")).to_have_text("preempted")

    carol.goto(f"/jobs/{job_id}/")
    expect(carol.get_by_test_id("job-state")).to_have_text("preempted")
    marker_labels = carol.evaluate("window.meridianJob.data.timeline.markers.map(m => m.label)")
    assert "Preemption requested" in marker_labels and "Preemption approved" in marker_labels
    on_server(transition, job_id, "cancelled", "test done")


def test_the_heatmap_changes_when_a_job_starts(login, on_server):
    page = login("alice")
    page.goto("/")
    wait_live(page)
    allocated_before = int(page.get_by_test_id("total-allocated").inner_text())
    cells_before = page.evaluate("window.meridianFleet.data.heatmap.allocated.flat().reduce((a, v) => a + (v || 0), 0)")

    def start_a_job():
        from django.db import transaction

        from fleet.models import Accelerator

        # min_devices 4: the seed fleet's nodes hold 4 devices and a job may not span nodes, so
        # submitting asks no more (the 8 devices it is placed on below are this test's own doing)
        job = submit_as_alice({"name": unique("heat"), "tier": "premium", "world_size": 8, "min_devices": 4})
        # One transaction, as the control loop applies a plan: the pushes go out on commit,
        # so every refetch they cause sees the placement, the telemetry and the new state.
        with transaction.atomic():
            devices = free_devices(8)
            job = place_job(job, devices)
            # The agents' telemetry (no agent runs here): the ranks keep their devices busy.
            for i, device in enumerate(devices):
                Accelerator.objects.filter(pk=device.pk).update(utilization=0.95 - 0.05 * i, memory_used_gb=0)
            return transition(job.pk, "running", "ranks started").pk

    job_id = on_server(start_a_job)
    expect(page.get_by_test_id("total-allocated")).to_have_text(str(allocated_before + 8))
    wait_for(
        page,
        "before => window.meridianFleet.data.heatmap.allocated.flat()"
        ".reduce((a, v) => a + (v || 0), 0) > before + 0.01",
        arg=cells_before,
    )
    page.screenshot(path=str(artifacts_dir() / "fleet.png"), full_page=True)

    # Colour by what is actually used: the mean telemetry of the cluster's reporting devices.
    page.select_option("#metric", "used")
    wait_for(
        page,
        "JSON.stringify(document.getElementById('heatmap').data[0].z)"
        " === JSON.stringify(window.meridianFleet.data.heatmap.used)"
    )
    mean_used = sum(0.95 - 0.05 * i for i in range(8)) / 8
    wait_for(
        page,
        "mean => Math.abs(Math.max(...window.meridianFleet.data.heatmap.used.flat().map(v => v || 0)) - mean) < 1e-3",
        arg=mean_used,
    )

    # Drill down: click the top-left cell (region demo-r00, its first cluster).
    box = page.locator("#heatmap .nsewdrag").first.bounding_box()
    page.mouse.click(box["x"] + box["width"] * 0.25, box["y"] + box["height"] * 0.25)
    page.wait_for_url(re.compile(r"\?cluster=\d+$"))
    expect(page.locator("#breadcrumbs")).to_contain_text("demo-r00/c00")
    wait_live(page)

    def finish(job_id):
        from fleet.models import Accelerator

        transition(job_id, "cancelled", "test done")
        Accelerator.objects.update(utilization=None)

    on_server(finish, job_id)
    wait_for(page, "window.meridianFleet.data.totals.allocated === %d" % allocated_before)


def test_a_submitter_is_refused_the_approvals_page_and_other_teams_jobs(login, on_server):
    job_id = on_server(lambda: submit_as_alice({"name": unique("private"), "tier": "basic", "world_size": 1}).pk)

    alice = login("alice")
    expect(alice.get_by_test_id("nav-approvals")).to_have_count(0)
    response = alice.goto("/approvals/")
    assert response.status == 403

    charlie = login("charlie")
    response = charlie.goto(f"/jobs/{job_id}/")
    assert response.status == 404
    charlie.goto("/jobs/")
    expect(charlie.locator(f'tr[data-job-id="{job_id}"]')).to_have_count(0)
