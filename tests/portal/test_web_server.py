"""portal.web_server: the one command line Meridian's web processes run (uvicorn). Each argv is
parsed by uvicorn's own command-line parser, so a flag that uvicorn does not know fails here, and
what it sets is checked against the daphne defaults Meridian kept (see the module doc)."""
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
