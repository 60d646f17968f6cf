"""`meridian logs JOB [-f] [--rank r] [--json]`: a job's log across all its attempts.

Prints the log from its start (or, with --tail N, its newest N chunks), markers included (a
preemption, a move, a resize); with -f it follows the log (polling the cursor of
GET /api/jobs/<id>/logs/) until the job ends and everything it printed has been shown. --rank
keeps one rank's output (default: every rank, each line prefixed with its rank when W > 1).
--json prints one JSON object per chunk (seq, kind, rank, generation, attempt, text).

Runs as a command of the `meridian` CLI (cli/main.py's registry) or on its own:
    python -m cli.logs --url URL --token TOKEN JOB [-f]      (MERIDIAN_URL / MERIDIAN_TOKEN)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator

FINAL_STATES = {"succeeded", "failed", "cancelled"}
PAGE = 500
FOLLOW_RETRY_S = 300.0  # how long `-f` keeps trying a control plane that does not answer


class LogsCliError(RuntimeError):
    """A request failed in a way the user can act on (the message says how). `status`: the HTTP
    status that caused it; None: no answer (unreachable, timed out)."""

    def __init__(self, message, *, status=None):
        super().__init__(message)
        self.status = status


def transient(exc: Exception) -> bool:
    """True for a failed request worth trying again while following: no answer (the control plane
    is restarting, or too busy to answer in time), a 5xx, 408 or 429. A 4xx is the answer."""
    status = getattr(exc, "status", 0)
    return status is None or status >= 500 or status in (408, 429)


class StandaloneClient:
    """URL + token, GET only: what `meridian logs` needs when the CLI's own client (cli/client.py)
    is absent. Paths are relative to the base URL ("/api/jobs/"), as there."""

    def __init__(self, url, token, *, timeout_s=30.0):
        import requests

        if not url:
            raise LogsCliError("no control plane URL: pass --url or set MERIDIAN_URL")
        self.url = url.rstrip("/")
        self.session = requests.Session()
        if token:
            self.session.headers["Authorization"] = f"Token {token}"
        self.timeout_s = timeout_s

    def get(self, path, params=None):
        import requests

        try:
            response = self.session.get(f"{self.url}{path}", params=params, timeout=self.timeout_s)
        except requests.RequestException as exc:
            raise LogsCliError(f"cannot reach {self.url}: {exc}", status=None) from None
        if response.status_code >= 400:
            try:
                detail = response.json()
            except ValueError:
                detail = response.text[:300]
            raise LogsCliError(f"GET {path}: {response.status_code} {detail}", status=response.status_code)
        return response.json()


def follow_logs(client, job_id, *, rank=None, after=0, follow=False, tail=None, poll_s=1.0,
                deadline=None, retry_for_s=FOLLOW_RETRY_S) -> Iterator[dict]:
    """Yields the chunks of job `job_id`'s log after cursor `after` (oldest first); with `follow`,
    keeps polling until the job is in a final state and a last fetch found nothing new (or
    `deadline`, a time.monotonic() value, passed). While following, a poll that fails for a
    passing reason (transient(): no answer in time, a 5xx) is tried again from the same cursor, for
    up to `retry_for_s` seconds in a row (said once on stderr), rather than ending the follower
    while the job prints on."""
    params: dict = {"limit": PAGE}
    if rank is not None:
        params["rank"] = rank
    if tail:
        answer = client.get(f"/api/jobs/{job_id}/logs/", params={**params, "limit": tail, "tail": 1})
        yield from answer["chunks"]
        after = answer["next"]
    failing_since = None
    while True:
        try:
            answer = client.get(f"/api/jobs/{job_id}/logs/", params={**params, "after": after})
        except Exception as exc:  # noqa: BLE001 - CliError or LogsCliError, by the client in use
            if not follow or not transient(exc):
                raise
            now = time.monotonic()
            if failing_since is None:
                failing_since = now
                print(f"meridian logs: {exc}; trying again", file=sys.stderr, flush=True)
            if now - failing_since > retry_for_s or (deadline is not None and now > deadline):
                raise
            time.sleep(poll_s)
            continue
        failing_since = None
        yield from answer["chunks"]
        after = answer["next"]
        if len(answer["chunks"]) == PAGE:
            continue  # more is waiting
        if not follow or (deadline is not None and time.monotonic() > deadline):
            return
        if answer.get("state") in FINAL_STATES:
            # The last output may still be on its way from the agent: one more look, then stop.
            time.sleep(poll_s)
            final = client.get(f"/api/jobs/{job_id}/logs/", params={**params, "after": after})
            yield from final["chunks"]
            if len(final["chunks"]) < PAGE:
                return
            after = final["next"]
            continue
        time.sleep(poll_s)


def render(chunk, *, world_size_known_multi) -> str:
    text = chunk["text"]
    if chunk["kind"] == "output" and world_size_known_multi and chunk["rank"] is not None:
        prefix = f"[{chunk['rank']}] "
        return "".join(prefix + line for line in text.splitlines(keepends=True))
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", type=int, help="the job id")
    parser.add_argument("-f", "--follow", action="store_true", help="follow the log until the job ends")
    parser.add_argument("--rank", type=int, default=None, help="one rank's output (and the markers)")
    parser.add_argument("--tail", type=int, default=None, help="start with the newest N chunks")


def run(args, client) -> int:
    """Prints the log; returns 0. Under the meridian CLI a request that fails raises its
    CliError (cli.main prints it and exits with its code); standalone, a LogsCliError is printed
    here and the exit code is 1."""
    try:
        first = client.get(f"/api/jobs/{args.job}/logs/", params={"limit": 1, "after": 0})
        multi = args.rank is None and first.get("world_size", 1) > 1
        for chunk in follow_logs(client, args.job, rank=args.rank, follow=args.follow, tail=args.tail):
            if getattr(args, "json", False):
                sys.stdout.write(json.dumps(chunk) + "\n")
            else:
                sys.stdout.write(render(chunk, world_size_known_multi=multi))
            sys.stdout.flush()
    except KeyboardInterrupt:
        return 130
    except LogsCliError as exc:
        print(f"meridian logs: error: {exc}", file=sys.stderr)
        return 1
    return 0


try:  # a command of the meridian CLI, when its registry is there
    from cli.main import command as _command
except ImportError:
    _command = None
if _command is not None:
    _command("logs", help="print (and with -f follow) a job's log", add_arguments=add_arguments)(run)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="meridian logs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("MERIDIAN_URL"))
    parser.add_argument("--token", default=os.environ.get("MERIDIAN_TOKEN"))
    parser.add_argument("--json", action="store_true", help="one JSON object per chunk")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        client = StandaloneClient(args.url, args.token)
    except LogsCliError as exc:
        print(f"meridian logs: {exc}", file=sys.stderr)
        return 2
    return run(args, client)


if __name__ == "__main__":
    sys.exit(main())
