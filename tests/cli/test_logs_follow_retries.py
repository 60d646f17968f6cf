"""`meridian logs -f` follows a job through a control plane that fails to answer for a while (a
5xx, a poll that times out under load): it tries again from the same cursor instead of ending
while the job prints on; a 4xx still ends it."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cli.client import Client, CliError
from cli.logs import LogsCliError, StandaloneClient, follow_logs


def chunk(seq, text):
    return {"seq": seq, "kind": "output", "rank": 0, "stream": "stdout", "generation": 1, "attempt": 1,
            "text": text, "created_at": "2026-12-01T00:00:00Z"}


class Plane:
    """A control plane's GET /api/jobs/1/logs/ on a real socket, answering `script` in turn (a
    status and a body); the cursors it was asked for are kept."""

    def __init__(self, script):
        self.script, self.afters = list(script), []
        plane = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                plane.afters.append(self.path.split("after=")[-1].split("&")[0])
                status, body = plane.script.pop(0) if plane.script else (200, {"chunks": [], "state": "succeeded"})
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def answer(seq=None, text="", state="running"):
    chunks = [chunk(seq, text)] if seq else []
    return 200, {"chunks": chunks, "next": seq or 0, "state": state, "world_size": 1}


@pytest.fixture
def clients():
    planes = []

    def make(script, kind):
        plane = Plane(script)
        planes.append(plane)
        client = StandaloneClient(plane.url, "t") if kind == "standalone" else Client(plane.url, "t")
        return plane, client

    yield make
    for plane in planes:
        plane.close()


@pytest.mark.parametrize("kind", ["standalone", "meridian"])
def test_a_follower_tries_again_through_5xx_answers_from_the_same_cursor(clients, kind):
    busy = (503, {"detail": "database is locked"})
    plane, client = clients([answer(21, "epoch 0 loss 0.6\n"), busy, (500, {"detail": "x"}), busy,
                             answer(22, "epoch 1 loss 0.5\n"), answer(23, "epoch 2 loss 0.4\n", state="succeeded")],
                            kind)
    texts = [c["text"] for c in follow_logs(client, 1, rank=0, follow=True, poll_s=0.01)]
    assert texts == ["epoch 0 loss 0.6\n", "epoch 1 loss 0.5\n", "epoch 2 loss 0.4\n"]
    assert plane.afters[:5] == ["0", "21", "21", "21", "21"]


@pytest.mark.parametrize("kind", ["standalone", "meridian"])
def test_a_follower_still_ends_on_a_4xx_and_without_follow_on_any_error(clients, kind):
    error = LogsCliError if kind == "standalone" else CliError
    plane, client = clients([answer(5, "a\n"), (404, {"detail": "Not found."})], kind)
    with pytest.raises(error):
        list(follow_logs(client, 1, follow=True, poll_s=0.01))
    plane, client = clients([(503, {"detail": "busy"})], kind)
    with pytest.raises(error):
        list(follow_logs(client, 1, follow=False))


def test_a_follower_gives_up_after_its_retry_window(clients):
    plane, client = clients([(503, {"detail": "busy"})] * 50, "standalone")
    with pytest.raises(LogsCliError):
        list(follow_logs(client, 1, follow=True, poll_s=0.01, retry_for_s=0.05))
