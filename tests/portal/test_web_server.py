"""portal.web_server: the one command line Meridian's web processes run (uvicorn). Each argv is
parsed by uvicorn's own command-line parser, so a flag that uvicorn does not know fails here, and
what it sets is checked against the daphne defaults Meridian kept (see the module doc)."""
import os
import sys
from pathlib import Path

import pytest
from uvicorn.main import main as uvicorn_command

from portal.web_server import KEEP_ALIVE_SECONDS, web_server_argv

BIN = Path(sys.executable).parent


def uvicorn_params(argv):
    """Returns the parameters uvicorn's command line would run with for `argv` (not started)."""
    assert argv[0] == str(BIN / "uvicorn")
    return uvicorn_command.make_context("uvicorn", list(argv[1:])).params


def test_it_serves_portal_asgi_with_uvloop_httptools_and_websockets_on_the_given_port():
    params = uvicorn_params(web_server_argv(bin_dir=BIN, bind="0.0.0.0", port=8123))

    assert params["app"] == "portal.asgi:application"
    assert (params["host"], params["port"], params["uds"], params["fd"]) == ("0.0.0.0", 8123, None, None)
    assert (params["loop"], params["http"], params["ws"]) == ("uvloop", "httptools", "websockets-sansio")
    assert params["lifespan"] == "off" and params["access_log"] is True


def test_it_trusts_no_proxy_header_itself_django_decides():
    """uvicorn's default rewrites the client address and scheme from X-Forwarded-* sent by any peer
    on 127.0.0.1 (the usual proxy), which would change who django-axes locks out."""
    assert uvicorn_params(web_server_argv(bin_dir=BIN, port=8000))["proxy_headers"] is False


def test_it_keeps_daphnes_timeouts_and_websocket_limits():
    params = uvicorn_params(web_server_argv(bin_dir=BIN, port=8000))

    # an agent beats every 5 s on one keep-alive connection: uvicorn's default (5 s) would race it
    assert params["timeout_keep_alive"] == KEEP_ALIVE_SECONDS == 60
    assert (params["ws_ping_interval"], params["ws_ping_timeout"]) == (20, 30)
    assert params["ws_max_size"] == 1024 * 1024 and params["ws_per_message_deflate"] is False
    # an open WebSocket (a live page) must not hold a stop forever: daphne gave the app 10 s
    assert params["timeout_graceful_shutdown"] == 10


def test_it_listens_on_a_unix_socket_or_an_inherited_socket_and_on_exactly_one_thing():
    assert uvicorn_params(web_server_argv(bin_dir=BIN, uds="/tmp/m.sock"))["uds"] == "/tmp/m.sock"
    assert uvicorn_params(web_server_argv(bin_dir=BIN, fd=7))["fd"] == 7
    assert uvicorn_params(web_server_argv(bin_dir=BIN, port=1, access_log=False))["access_log"] is False
    with pytest.raises(ValueError, match="exactly one"):
        web_server_argv(bin_dir=BIN, port=8000, fd=3)
    with pytest.raises(ValueError, match="exactly one"):
        web_server_argv(bin_dir=BIN)


def _status_app_source():
    """A tiny ASGI app answering each request with the status its X-Status header asks for."""
    return (
        "async def app(scope, receive, send):\n"
        "    if scope['type'] != 'http':\n"
        "        return\n"
        "    status = int(dict(scope['headers']).get(b'x-status', b'200'))\n"
        "    await send({'type': 'http.response.start', 'status': status, 'headers': []})\n"
        "    await send({'type': 'http.response.body', 'body': b'ok'})\n"
    )


def test_agents_answered_beats_leave_no_access_line_everything_else_keeps_its_own(tmp_path):
    """Real uvicorn with Meridian's command line (its log config) on a stand-in app: an agent's
    lease or full heartbeat answered below 400 writes no access line (2,500 a second at 12,500
    nodes; the line was ~40% of a lease's CPU); a refused one, another path, or a beat with a query
    string (which goes through Django) keeps its line."""
    import socket
    import subprocess
    import time

    import requests

    (tmp_path / "status_app.py").write_text(_status_app_source())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = web_server_argv(bin_dir=BIN, port=port)
    argv[argv.index("portal.asgi:application")] = "status_app:app"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).parents[2])])}
    log = tmp_path / "web.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                requests.get(f"{base}/ready", timeout=1)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline and server.poll() is None, log.read_text()
                time.sleep(0.1)
        asks = [("/api/agent/lease/", 200), ("/api/agent/heartbeat/", 200), ("/api/agent/lease/", 401),
                ("/api/agent/heartbeat/", 503), ("/api/agent/lease/?x=1", 200), ("/api/jobs/", 201)]
        for path, status in asks:
            assert requests.post(base + path, headers={"X-Status": str(status)}, timeout=5).status_code == status
    finally:
        server.terminate()
        server.wait(timeout=20)
    lines = [line for line in log.read_text().splitlines() if '"POST ' in line]

    assert lines and all("HTTP/1.1" in line for line in lines), lines
    # uvicorn's access line: ... "POST <path> HTTP/1.1" <status> <phrase>
    logged = {(line.split('"POST ')[1].split(" HTTP/")[0], int(line.split('" ')[1].split()[0])) for line in lines}
    assert logged == {("/api/agent/lease/", 401), ("/api/agent/heartbeat/", 503), ("/api/agent/lease/?x=1", 200),
                      ("/api/jobs/", 201)}
