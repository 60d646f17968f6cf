"""The job page's live log tail in real Chromium: what a rank prints shows up without a reload,
for the rank selected; a preemption marker shows for every rank; a failed job's page shows the
tail of the failing rank's log next to its failure reason."""
import time
import uuid

import pytest
from log_tail_harness import LogNode
from playwright.sync_api import expect

pytestmark = pytest.mark.browser


def transition(job_id, to, reason=""):
    from jobs.models import Job
    from jobs.services import job_transition

    return job_transition(job=Job.objects.get(pk=job_id), to=to, reason=reason)


def fail(job_id, reason):
    from jobs.models import Job

    Job.objects.filter(pk=job_id).update(failure_reason=reason)
    return transition(job_id, "failed", reason[:100])


def test_the_job_page_tails_the_selected_ranks_log_live(login, on_server, portal, tmp_path):
    node = LogNode(portal, tmp_path, world_size=2)
    try:
        page = login("alice")
        node.print_line(0, "hello from before the page opened")
        page.goto(f"/jobs/{node.job_id}/")
        page.wait_for_selector('body[data-live="subscribed"]', state="attached")
        log = page.get_by_test_id("job-log")
        expect(log).to_contain_text("hello from before the page opened")

        token = uuid.uuid4().hex[:8]
        printed = time.time() * 1000
        node.print_line(0, f"live line {token}")
        node.print_line(1, f"rank one line {token}")
        expect(log).to_contain_text(f"live line {token}")
        print(f"\nprint -> visible in the browser: {int(log.get_attribute('data-rendered-at')) - printed:.0f} ms")
        expect(log).not_to_contain_text(f"rank one line {token}")  # rank 0 is selected

        page.get_by_test_id("log-rank").select_option("1")
        expect(log).to_contain_text(f"rank one line {token}")
        expect(log).not_to_contain_text(f"live line {token}")

        on_server(transition, node.job_id, "running", "ranks started")
        on_server(transition, node.job_id, "preempting", "a premium job needs the devices")
        expect(log.locator(".marker")).to_contain_text("preempting")
    finally:
        node.close()


def test_a_failed_jobs_page_shows_the_failing_ranks_log_tail_beside_the_reason(login, on_server, portal, tmp_path):
    node = LogNode(portal, tmp_path, world_size=2)
    try:
        node.print_line(0, "rank 0 was fine")
        node.print_line(1, "Traceback (most recent call last):")
        node.print_line(1, "ValueError: the loss is nan")
        page = login("alice")
        page.goto(f"/jobs/{node.job_id}/")
        expect(page.get_by_test_id("job-log")).to_contain_text("rank 0 was fine")
        on_server(transition, node.job_id, "running", "ranks started")
        on_server(fail, node.job_id, "rank 1 exited with code 1; the job fails.")
        page.reload()
        expect(page.get_by_test_id("failure-reason")).to_contain_text("rank 1 exited with code 1")
        tail = page.get_by_test_id("failure-tail")
        expect(tail).to_contain_text("ValueError: the loss is nan")
        expect(tail).not_to_contain_text("rank 0 was fine")
    finally:
        node.close()
