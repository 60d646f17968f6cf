"""The CLI's one way to talk to a control plane: `Client` (URL + API token), `CliError`, and
the output helpers every command uses (`print_json`, `print_table`).

Where the URL and token come from, first found wins: the command line (`--url`, `--token`),
the environment (`MERIDIAN_URL`, `MERIDIAN_TOKEN`), the config file `meridian login` writes
($XDG_CONFIG_HOME/meridian/config.json, else ~/.config/meridian/config.json, mode 600).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import requests

DEFAULT_TIMEOUT = (10.0, 60.0)  # (connect, read) seconds


class CliError(Exception):
    """A failure to tell the user in one line; main() prints it and exits with `exit_code`."""

    def __init__(self, message: str, *, exit_code: int = 1, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.status = status  # the HTTP status that caused it; None: no answer (unreachable, timed out)


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "meridian" / "config.json"


def config_load() -> dict[str, str]:
    """Returns the saved config ({} when there is none); a corrupt file is a CliError naming it."""
    path = config_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc}") from exc
    try:
        loaded = json.loads(text)
    except ValueError as exc:
        raise CliError(f"{path} is not valid JSON ({exc}); run `meridian login URL` again") from exc
    if not isinstance(loaded, dict):
        raise CliError(f"{path} should hold a JSON object; run `meridian login URL` again")
    return {str(k): str(v) for k, v in loaded.items() if isinstance(v, str)}


def config_save(values: dict[str, str]) -> Path:
    """Writes the config atomically with mode 600 (the token is a secret) and returns its path."""
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config-", suffix=".json")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(values, handle, indent=2)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _error_message(response: requests.Response) -> str:
    """The control plane's 4xx body as one line: DRF's {"detail": ...} or {field: [messages]}."""
    try:
        body = response.json()
    except ValueError:
        text = response.text.strip().splitlines()
        return text[0][:300] if text else response.reason or "no message"
    if isinstance(body, dict):
        if "detail" in body and len(body) == 1:
            return str(body["detail"])
        parts = []
        for field, messages in body.items():
            if isinstance(messages, list):
                messages = "; ".join(str(m) for m in messages)
            parts.append(f"{field}: {messages}")
        return "; ".join(parts)
    return str(body)[:300]


class Client:
    """An authenticated session with one control plane.

    `get`/`post`/`put`/`head` return the decoded JSON body (None for an empty body) and raise
    CliError on a connection failure or an HTTP error (the message is the server's); `stream`
    returns the open response for the caller to iterate (close it, or use it as a context
    manager). Paths are relative to the base URL ("/api/jobs/")."""

    def __init__(self, url: str | None, token: str | None, *, timeout: tuple[float, float] = DEFAULT_TIMEOUT):
        self.url = (url or "").rstrip("/")
        self.token = token or ""
        self.timeout = timeout
        self.session = requests.Session()
        if self.token:
            self.session.headers["Authorization"] = f"Token {self.token}"

    @classmethod
    def from_config(cls, *, url: str | None = None, token: str | None = None) -> Client:
        saved = config_load()
        return cls(
            url or os.environ.get("MERIDIAN_URL") or saved.get("url"),
            token or os.environ.get("MERIDIAN_TOKEN") or saved.get("token"),
        )

    def require_login(self) -> None:
        if not self.url:
            raise CliError("no control plane URL: run `meridian login URL` or set MERIDIAN_URL")
        if not self.token:
            raise CliError(f"not logged in to {self.url}: run `meridian login {self.url}` or set MERIDIAN_TOKEN")

    def absolute(self, path: str) -> str:
        return path if path.startswith(("http://", "https://")) else f"{self.url}{path}"

    def request(self, method: str, path: str, *, stream: bool = False, ok: Sequence[int] = (),
                **kwargs: Any) -> requests.Response:
        """Returns the response; an HTTP status >= 400 not in `ok` is a CliError."""
        if not self.url:
            raise CliError("no control plane URL: run `meridian login URL` or set MERIDIAN_URL")
        kwargs.setdefault("timeout", self.timeout)
        try:
            response = self.session.request(method, self.absolute(path), stream=stream, **kwargs)
        except requests.ConnectionError as exc:
            raise CliError(f"cannot reach {self.url} ({type(exc).__name__}); is the control plane running?") from exc
        except requests.Timeout as exc:
            raise CliError(f"{self.url} did not answer {method} {path} in time") from exc
        except requests.RequestException as exc:
            raise CliError(f"{method} {path} failed: {exc}") from exc
        if response.status_code >= 400 and response.status_code not in ok:
            message = _error_message(response)
            response.close()
            # DRF answers a bad token with 401, or 403 when session auth comes first in its list.
            if response.status_code == 401 or (response.status_code == 403 and any(
                    word in message.lower() for word in ("invalid token", "credentials were not provided"))):
                raise CliError(f"{self.url} refused the token ({message}): run `meridian login {self.url}`",
                               status=response.status_code)
            raise CliError(f"{method} {path}: HTTP {response.status_code}: {message}", status=response.status_code)
        return response

    @staticmethod
    def _json(response: requests.Response) -> Any:
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise CliError(f"the server answered {response.url} with something that is not JSON") from exc

    def get(self, path: str, *, params: dict[str, Any] | None = None) -> Any:
        return self._json(self.request("GET", path, params=params))

    def post(self, path: str, body: Any = None, **kwargs: Any) -> Any:
        return self._json(self.request("POST", path, json=body, **kwargs))

    def put(self, path: str, *, data: BinaryIO | bytes, headers: dict[str, str] | None = None) -> Any:
        return self._json(self.request("PUT", path, data=data, headers=headers))

    def head(self, path: str) -> int:
        """Returns the status code (404 is an answer here, not an error)."""
        return self.request("HEAD", path, ok=(404,)).status_code

    def stream(self, path: str, *, params: dict[str, Any] | None = None,
               timeout: tuple[float, float | None] | None = None) -> requests.Response:
        return self.request("GET", path, params=params, stream=True, timeout=timeout or self.timeout)

    def iter_pages(self, path: str, *, params: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
        """Yields every item of a paginated list ({"results": [...], "next": url}) or a plain list."""
        page: Any = self.get(path, params=params)
        while True:
            if isinstance(page, list):
                yield from page
                return
            yield from page.get("results", [])
            following = page.get("next")
            if not following:
                return
            page = self._json(self.request("GET", following))


def print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def print_table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> None:
    """Prints rows under headers, columns padded to their widest cell (None prints as "-")."""
    cells = [[("-" if cell is None else str(cell)) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    line = "  ".join(h.ljust(widths[i]) for i, h in enumerate(headers)).rstrip()
    print(line)
    for row in cells:
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
