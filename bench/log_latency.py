"""Live-log latency: a line a rank prints → visible on the job page, in real Chromium.

The path measured is the production one end to end: the line is appended to the rank's log
file (a write(2), as a rank's line-buffered print does), the agent's LogShipper (agent/logs.py,
polling every --poll seconds; the agent's default is 0.2 s) reads it and POSTs it to uvicorn
(/api/agent/logs/: fencing, the LogChunk insert, the push on commit), Channels + Redis push
"jobs.log_appended" to the page's WebSocket, the page fetches GET /api/jobs/<id>/logs/ from its
cursor and appends the text. Each time runs from just before the write to the page's
data-rendered-at (the browser's Date.now() after it appended the chunk; same machine, same
clock). Prints go one at a time (the next after the previous is visible), --prints of them.

The portal is the browser tests' (tests/browser/browser_harness.py); the node is
tests/browser/log_tail_harness.py's LogNode (a job placed on one of the portal's nodes, that
node's token, the agent's shipper; no training process).

Usage:
  .venv/bin/python bench/log_latency.py [--prints 30] [--poll 0.2]
"""
import argparse
import statistics
import time
import uuid
from pathlib import Path

from browser_bench import database_name, django_setup, logged_in_page, percentile


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prints", type=int, default=30)
    parser.add_argument("--poll", type=float, nargs="+", default=[0.2],
                        help="the shipper's poll interval(s) to measure (the agent's default: 0.2 s)")
    args = parser.parse_args()

    data_dir = django_setup("meridian-log-latency-")
    from browser_harness import PortalServer
    from log_tail_harness import LogNode
    from playwright.sync_api import expect, sync_playwright

    server = PortalServer().start()
    results = {}
    try:
        with sync_playwright() as playwright:
            browser, page = logged_in_page(playwright, server)
            for poll_s in args.poll:
                node = LogNode(server, Path(data_dir.name) / f"node-{poll_s}", world_size=1, poll_s=poll_s)
                try:
                    page.goto(f"/jobs/{node.job_id}/")
                    page.wait_for_selector('body[data-live="subscribed"]', state="attached")
                    log = page.get_by_test_id("job-log")
                    times = []
                    for i in range(args.prints + 1):
                        token = uuid.uuid4().hex[:10]
                        printed_ms = time.time() * 1000
                        node.print_line(0, f"print {i} {token}")
                        expect(log.locator("span", has_text=token)).to_have_count(1)
                        rendered = int(log.get_attribute("data-rendered-at"))
                        if i:  # the first warms the page's fetch path up
                            times.append(rendered - printed_ms)
                        time.sleep(0.05 + (i % 7) * 0.031)  # spread prints over the shipper's poll phase
                    results[poll_s] = times
                finally:
                    node.close()
            browser.close()
    finally:
        server.stop()

    database = database_name()
    print(f"\nlog latency, print → visible in the browser ({database}, uvicorn, Channels + Redis, Chromium), "
          f"{args.prints} prints each\n")
    print(f"{'shipper poll (s)':>17} {'median ms':>10} {'p90 ms':>8} {'min ms':>8} {'max ms':>8}")
    for poll_s, times in results.items():
        print(f"{poll_s:>17.2f} {statistics.median(times):>10.0f} {percentile(times, 0.9):>8.0f} "
              f"{min(times):>8.0f} {max(times):>8.0f}")


if __name__ == "__main__":
    main()
