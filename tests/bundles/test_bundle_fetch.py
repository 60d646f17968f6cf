"""The agent fetches bundles in the background (agent/bundles.py BackgroundFetches): a real
NodeReconciler with the real fetch_bundle against a real HTTP server that serves the bundle as
slowly as the test says. While a download hangs, the agent's beats (observed() and reconcile(),
what agent.main's heartbeat loop runs, under the reconciler's lock) go on, counted; the job is
reported as starting, "fetching code"; once the bytes arrive, the next reconcile launches it.
A server error is reported with its reason and tried again; a refusal (404) fails the copy."""
import hashlib
import http.server
import pathlib
import threading

import pytest
from polling import poll

from agent.bundles import BackgroundFetches, fetch_bundle
from agent.client import ControlPlaneClient
from agent.node import NodeReconciler
from protocol import bundle

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARCHIVE = bundle.pack_bytes({"main.py": b"print('hello from the bundle')\n"})
SHA = hashlib.sha256(ARCHIVE).hexdigest()


class BundleServer(http.server.ThreadingHTTPServer):
    """Serves GET /api/agent/bundles/<SHA>/: the first half of the bytes at once, the rest once
    `release` is set; `status` other than 200 answers that instead. Counts the requests."""

    daemon_threads = True

    def __init__(self):
        self.release = threading.Event()
        self.status = 200
        self.requests = 0
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):  # noqa: N802 - http.server's name
        server = self.server
        server.requests += 1
        if self.path != f"/api/agent/bundles/{SHA}/" or server.status != 200:
            self.send_response(server.status if server.status != 200 else 404)
            self.end_headers()
            self.wfile.write(b"not here")
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(ARCHIVE)))
        self.end_headers()
        self.wfile.write(ARCHIVE[: len(ARCHIVE) // 2])
        self.wfile.flush()
        server.release.wait(120)
        self.wfile.write(ARCHIVE[len(ARCHIVE) // 2:])


@pytest.fixture
def server():
    serving = BundleServer()
    yield serving
    serving.release.set()
    serving.shutdown()


def make_node(tmp_path, server):
    client = ControlPlaneClient(server.url, token="node-token")
    return NodeReconciler(tmp_path / "w", engine="framework", checkpoint_every_s=0, workload_root=ROOT,
                          bundle_fetcher=lambda sha256: fetch_bundle(client, sha256, tmp_path / "w" / "bundles"))


def desired(job_id, tmp_path):
    return [{"job_id": job_id, "action": "run", "generation": 1, "world_size": 1, "devices": 1, "device_indices": [0],
             "entrypoint": "main.py", "bundle": SHA, "args": [], "env": {},
             "store": str(tmp_path / "store" / f"job-{job_id}" / "g1")}]


def beat(node, entries):
    """One heartbeat's worth of the reconciler's work, as agent.main's beat() does it; returns the reports."""
    reports = {r.job_id: r for r in node.observed()}
    node.reconcile(entries)
    return reports


def test_a_slow_bundle_server_does_not_hold_up_the_heartbeats_and_the_job_says_it_is_fetching_code(tmp_path, server):
    node = make_node(tmp_path, server)
    entries = desired(7, tmp_path)
    beats = []

    def beating():  # the heartbeat loop, counting the beats it completes while the download hangs
        while not server.release.is_set():
            beats.append(beat(node, entries))
            server.release.wait(0.01)  # a (fast) heartbeat interval: the fetch thread gets its turn too

    loop = threading.Thread(target=beating, daemon=True)
    loop.start()
    try:
        # The download starts (its first half served, the rest held back), then 20 more beats go
        # by: the old code, which downloaded under the reconcile lock, completes none meanwhile.
        poll("the download to start", lambda: server.requests >= 1, timeout=60,
             on_timeout=lambda: f"{len(beats)} beats, no request")
        started_at = len(beats)
        poll("20 heartbeats during the download", lambda: len(beats) >= started_at + 20, timeout=60,
             on_timeout=lambda: f"{len(beats) - started_at} beats since the download started")
        assert server.requests == 1  # one download, however many reconciles asked
        report = beats[-1][7]
        assert report.state == "starting" and report.generation == 1
        assert report.waiting.startswith(f"fetching code (bundle {SHA[:12]}") and 7 not in node.jobs
    finally:
        server.release.set()
        loop.join(timeout=60)
    try:
        poll("the launch after the download", lambda: beat(node, entries) and 7 in node.jobs, timeout=60)
        assert 7 not in node.waiting and all(r.waiting is None for r in node.observed())
        assert (node.workspace_root / "job-7" / "main.py").is_file()
    finally:
        node.kill_all()


def test_a_failed_download_is_reported_with_its_reason_and_tried_again(tmp_path, server):
    server.status = 503
    node = make_node(tmp_path, server)
    node.bundle_fetches = BackgroundFetches(node.bundle_fetches._fetch, retry_after_s=0.2)
    entries = desired(8, tmp_path)
    report = poll("the failed try in the report", lambda: (r := beat(node, entries).get(8)) and "failed" in
                  (r.waiting or "") and r, timeout=30)
    assert "HTTP 503" in report.waiting and report.waiting.endswith("trying again")
    poll("a second try", lambda: beat(node, entries) and server.requests >= 2, timeout=30)
    assert 8 not in node.jobs


def test_a_bundle_the_control_plane_refuses_fails_the_copy_with_the_reason(tmp_path, server):
    server.status = 404
    node = make_node(tmp_path, server)
    entries = desired(9, tmp_path)
    poll("the copy to fail", lambda: beat(node, entries) and 9 in node.jobs, timeout=30)
    report = {r.job_id: r for r in node.observed()}[9]
    assert report.state == "failed" and "code bundle cannot be had" in report.error and "HTTP 404" in report.error
