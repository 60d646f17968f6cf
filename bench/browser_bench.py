"""What the browser benchmarks share (bench/log_latency.py, bench/portal_live_latency.py): the
stack's start-up (a private data dir, Django set up against portal.settings, the browser tests'
harness on sys.path), a logged-in Chromium page, and the percentile the tables print."""
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def django_setup(prefix):
    """Puts the repository and the browser tests' harness on sys.path, points MERIDIAN_DATA_DIR
    at a private temporary folder (unless set) and sets Django up; returns the folder's
    TemporaryDirectory (removed when it is dropped, at exit at the latest)."""
    for path in (REPO, REPO / "tests" / "browser", REPO / "tests"):  # the harness polls with tests/polling.py
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    data_dir = tempfile.TemporaryDirectory(prefix=prefix)
    os.environ.setdefault("MERIDIAN_DATA_DIR", data_dir.name)
    import django

    django.setup()
    from browser_harness import chromium_missing_reason

    reason = chromium_missing_reason()
    if reason:
        raise SystemExit(reason)
    return data_dir


def logged_in_page(playwright, server, username="alice", **context_options):
    """Launches Chromium, logs `username` (a demo user) into the portal at `server`; returns
    (browser, page)."""
    from browser_harness import chromium_launch, log_in

    browser = chromium_launch(playwright)
    page = log_in(browser.new_context(base_url=server.url, **context_options), username)
    return browser, page


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def database_name():
    return "PostgreSQL" if os.environ.get("DATABASE_URL", "").startswith("postgres") else "SQLite"
