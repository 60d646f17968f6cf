"""How Meridian serves HTTP and WebSockets: the one command line of its ASGI web server.

    python -m portal.web_server [--bind 127.0.0.1] [--port 8000 | --uds PATH | --fd N] [--no-access-log]

execs uvicorn on `portal.asgi:application` with uvloop and httptools, WebSockets (Channels: the
portal's live pages) through the `websockets` package's sans-I/O protocol. `./meridian run`, the
end-to-end and browser harnesses, the benches and the production docs all start the web server
through `web_server_argv`, so a setting changes in one place.

Why uvicorn (it replaced daphne in session 21): its per-request floor is a third to a half of
daphne's CPU and a lease 1.35-2.35x cheaper, the agents' minute of beats 1.3-1.5x
(bench/control_plane.py --server daphne,uvicorn; docs/results.md#asgi-servers); the leases are 5 of
an agent's 6 beats, and a lease is mostly that floor.

The settings keep what Meridian ran under daphne 4.2.3's defaults:
- proxy headers are not read by the server (`--no-proxy-headers`): Django alone decides what to
  trust (SECURE_PROXY_SSL_HEADER in the production profile, django-axes' AXES_IPWARE_* settings for
  client addresses). uvicorn's default would rewrite the client address and scheme from
  X-Forwarded-For/-Proto of any peer on 127.0.0.1, which daphne never did.
- an idle keep-alive connection is closed after 60 s (Twisted's default under daphne; uvicorn's
  own default, 5 s, equals the agents' beat period: an agent's POST would race the server closing
  its connection);
- WebSockets: a ping after 20 s idle, closed 30 s after an unanswered ping, messages of at most
  1 MiB, no per-message compression (daphne offered none; it costs CPU per push);
- on SIGTERM or SIGINT, requests and WebSockets still open get 10 s to end before they are
  cancelled (daphne's --application-close-timeout; uvicorn's default waits without a limit, and a
  live page's open WebSocket would hold a stop until the supervisor's SIGKILL);
- an access line per request on stdout (daphne's default; `--no-access-log` leaves it out), except
  an agent's answered liveness lease or full heartbeat (AgentBeatsFilter, through WEB_SERVER_LOG_CONFIG):
  a fleet of 12,500 nodes sends 2,500 of them a second, the access line was ~40% of a lease's web CPU
  (bench/control_plane.py --server uvicorn,uvicorn+noaccesslog: the floor 0.47x, the lease 0.64x
  without it), and /metrics counts them (heartbeats received and rejected); a refused beat (4xx/5xx)
  keeps its line;
- no lifespan events (Django and Channels have none).
Not kept: daphne closed a WebSocket after 24 h whatever happened on it (`--websocket_timeout`);
uvicorn has no such limit, and the live pages reconnect by themselves either way.

No Django import here: `portal.launch` (which supervises, and runs no Django) imports it.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

APPLICATION = "portal.asgi:application"
KEEP_ALIVE_SECONDS = 60  # daphne's (Twisted's) idle-connection timeout
WS_PING_INTERVAL_SECONDS = 20  # daphne's --ping-interval default
WS_PING_TIMEOUT_SECONDS = 30  # daphne's --ping-timeout default
WS_MAX_MESSAGE_BYTES = 1024 * 1024  # daphne's --websocket-max-message-size default
SHUTDOWN_SECONDS = 10  # daphne's --application-close-timeout default
# uvicorn's own logging config (uvicorn.config.LOGGING_CONFIG) with AgentBeatsFilter on its access logger
WEB_SERVER_LOG_CONFIG = Path(__file__).with_name("web_server_logging.json")
# The agents' beats (fleet/lease_api.py, jobs/heartbeat_api.py); a query string sends them through
# Django, and their access line stays.
AGENT_BEAT_PATHS = frozenset({"/api/agent/lease/", "/api/agent/heartbeat/"})


class AgentBeatsFilter(logging.Filter):
    """Drops uvicorn's access line of an agent's beat answered below 400 (see the module doc).
    uvicorn logs each request as the arguments (client, method, path, HTTP version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5:
            path, status = args[2], args[4]
            return not (path in AGENT_BEAT_PATHS and isinstance(status, int) and status < 400)
        return True


def web_server_argv(*, bin_dir: Path | str, bind: str = "127.0.0.1", port: int | None = None,
                    uds: Path | str | None = None, fd: int | None = None, access_log: bool = True) -> list[str]:
    """Returns the command line of one web process, listening on exactly one of `port` (on `bind`),
    the unix socket `uds`, or the inherited listening socket `fd` (several processes on one port).
    `bin_dir`: the virtual environment's bin folder (uvicorn's script lives there)."""
    if sum(x is not None for x in (port, uds, fd)) != 1:
        raise ValueError("give exactly one of port, uds or fd")
    if port is not None:
        listen = ["--host", bind, "--port", str(port)]
    elif uds is not None:
        listen = ["--uds", str(uds)]
    else:
        listen = ["--fd", str(fd)]
    return [
        str(Path(bin_dir) / "uvicorn"), APPLICATION, *listen,
        "--loop", "uvloop", "--http", "httptools", "--ws", "websockets-sansio",
        "--no-proxy-headers", "--lifespan", "off",
        "--timeout-keep-alive", str(KEEP_ALIVE_SECONDS), "--timeout-graceful-shutdown", str(SHUTDOWN_SECONDS),
        "--ws-ping-interval", str(WS_PING_INTERVAL_SECONDS), "--ws-ping-timeout", str(WS_PING_TIMEOUT_SECONDS),
        "--ws-max-size", str(WS_MAX_MESSAGE_BYTES), "--ws-per-message-deflate", "false",
        "--log-config", str(WEB_SERVER_LOG_CONFIG),
        *([] if access_log else ["--no-access-log"]),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m portal.web_server", description=__doc__.split("\n")[0])
    parser.add_argument("--bind", default="127.0.0.1", help="the address to listen on (with --port)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--port", type=int, help="the TCP port (default 8000)")
    where.add_argument("--uds", help="a unix socket's path instead of a TCP port")
    where.add_argument("--fd", type=int, help="an inherited listening socket instead of a TCP port")
    parser.add_argument("--no-access-log", dest="access_log", action="store_false",
                        help="leave out the access line per request")
    args = parser.parse_args(argv)
    port = args.port if args.port is not None or args.uds or args.fd is not None else 8000
    command = web_server_argv(bin_dir=Path(sys.executable).parent, bind=args.bind, port=port, uds=args.uds,
                              fd=args.fd, access_log=args.access_log)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
