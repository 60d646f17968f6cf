"""Meridian settings, read from the environment.

Embedded by default (SQLite in the data directory, a private Redis on a unix
socket that `./meridian run` starts), distributed when outgrown (DATABASE_URL,
REDIS_URL).  MERIDIAN_PROFILE=production turns DEBUG off and the cookies secure.

Environment variables:
  MERIDIAN_DATA_DIR   where the SQLite file, the secret key and the private Redis
                      socket live (default: <repo>/data)
  DATABASE_URL        e.g. postgres://postgres@127.0.0.1:5432/meridian
  REDIS_URL           Celery broker/result backend and Channels layer, e.g.
                      redis://127.0.0.1:6379/3; default: the private Redis socket
  SECRET_KEY          default: generated once into <data dir>/secret_key (mode 600)
  MERIDIAN_PROFILE    "development" (default) or "production"
  ALLOWED_HOSTS       comma-separated; required in production
  CSRF_TRUSTED_ORIGINS comma-separated origins, e.g. https://meridian.example.com

The control loop's knobs (read here once; code reads django.conf.settings at call time, so
tests override them with pytest-django's `settings` fixture): see "control loop" below.
"""
import os
import secrets
import tempfile
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("MERIDIAN_DATA_DIR") or BASE_DIR / "data").resolve()
DATA_DIR.mkdir(parents=True, exist_ok=True)



def _env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    """Returns the number in environment variable `name`, or `default` when unset or empty."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not a number") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={value!r} must be {minimum:g} or more")
    return number


def _env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    """Returns the whole number in environment variable `name`, or `default` when unset or empty."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not a whole number") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={value!r} must be {minimum} or more")
    return number


def _env_choice(name: str, default: str, *, choices: tuple[str, ...]) -> str:
    """Returns environment variable `name` (lower-cased) if it is one of `choices`, else raises."""
    value = os.environ.get(name, "").strip().lower() or default
    if value not in choices:
        raise ImproperlyConfigured(f"{name}={value!r}; choose one of {', '.join(choices)}")
    return value


PROFILE = os.environ.get("MERIDIAN_PROFILE", "development").strip().lower()
if PROFILE not in {"development", "production"}:
    raise ImproperlyConfigured(
        f"MERIDIAN_PROFILE={PROFILE!r} is not known; use 'development' or 'production'."
    )
PRODUCTION = PROFILE == "production"


def _secret_key_from_data_dir(data_dir):
    """Returns the key stored in <data_dir>/secret_key, creating it (mode 600) on first use.

    The key is written whole to a private temporary file and then hard-linked into place:
    link() is atomic and fails if the name exists, so processes starting at once agree on
    one key and none can read a file that is created but not yet written.
    """
    path = data_dir / "secret_key"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(prefix=".secret_key.", dir=data_dir)  # mode 600
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_urlsafe(50) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process won; its key is read below
        finally:
            os.unlink(tmp)
    key = path.read_text().strip()
    if key:
        return key
    raise ImproperlyConfigured(f"{path} is empty; delete it to generate a new key.")


SECRET_KEY = os.environ.get("SECRET_KEY") or _secret_key_from_data_dir(DATA_DIR)
DEBUG = not PRODUCTION

ALLOWED_HOSTS = [h.strip() for h in os.environ.get("ALLOWED_HOSTS", "").split(",") if h.strip()]
if not ALLOWED_HOSTS:
    if PRODUCTION:
        raise ImproperlyConfigured(
            "MERIDIAN_PROFILE=production needs ALLOWED_HOSTS, e.g. ALLOWED_HOSTS=meridian.example.com"
        )
    ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]", "testserver"]
CSRF_TRUSTED_ORIGINS = [
    o.strip() for o in os.environ.get("CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()
]

INSTALLED_APPS = [
    "daphne",  # its ASGI `runserver` for development; Meridian serves with uvicorn (portal/web_server.py)
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "channels",
    "axes",
    "portal",
    "fleet",
    "jobs",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "portal.metrics.HeartbeatMetricsMiddleware",  # sees every heartbeat's answer, refusals included
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "portal.middleware.ContentSecurityPolicyMiddleware",
    # last: turns a login refused for too many failures into lockout_response's 429
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "portal.urls"
WSGI_APPLICATION = "portal.wsgi.application"
ASGI_APPLICATION = "portal.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- database -----------------------------------------------------------------
DEFAULT_SQLITE_PATH = DATA_DIR / "meridian.sqlite3"
DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL") or f"sqlite:///{DEFAULT_SQLITE_PATH}",
        conn_max_age=_env_int("DATABASE_CONN_MAX_AGE", 60, minimum=0),
        conn_health_checks=True,
    )
}


def _private_sqlite_file(name):
    """Makes the SQLite file `name` (created empty when absent: SQLite takes an empty file as a new
    database) readable by its owner only; SQLite gives its -wal and -shm files the same mode. The
    data dir must stay reachable by job uids (the embedded agents' spools lie under it), so the
    database's own mode keeps a job's ranks out of it (docs/operator-guide.md#sandbox)."""
    if not name or str(name) == ":memory:" or str(name).startswith("file:"):
        return
    try:
        os.close(os.open(name, os.O_WRONLY | os.O_CREAT, 0o600))
        os.chmod(name, 0o600)
    except OSError:
        pass  # a read-only or missing data dir: Django says so when it connects


if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    _private_sqlite_file(DATABASES["default"].get("NAME"))
    # The embedded database is shared by the web server, a Celery worker and beat: WAL lets
    # readers go on while one writer writes, IMMEDIATE transactions take the write
    # lock up front (no "database is locked" on lock upgrade), and the timeout waits
    # for the lock instead of failing.
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    DATABASES["default"]["OPTIONS"] = {
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        "transaction_mode": "IMMEDIATE",
        "timeout": 30,
    }
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql" and _env_int("MERIDIAN_DB_POOL", 1, minimum=0):
    # Django's PostgreSQL connection pool (psycopg-pool): each process opens at most
    # MERIDIAN_DB_POOL_MAX_SIZE connections, however many threads ASGI runs views in, and a request
    # hands its connection back when it ends. CONN_MAX_AGE=60 without it kept one connection per
    # worker thread, and 32 clients against 2 daphne processes (then the server) ran PostgreSQL out of connections
    # ("too many clients already", issue 18). The server's max_connections must cover
    # (web processes + Celery worker processes + beat) * max_size (docs/operator-guide.md).
    # A request that waits longer than the timeout for a connection fails instead of hanging.
    DATABASES["default"]["CONN_MAX_AGE"] = 0  # the pool keeps connections; Django refuses both
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": _env_int("MERIDIAN_DB_POOL_MIN_SIZE", 1, minimum=0),
        "max_size": _env_int("MERIDIAN_DB_POOL_MAX_SIZE", 8, minimum=1),
        "timeout": _env_float("MERIDIAN_DB_POOL_TIMEOUT", 10.0, minimum=0.1),
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Redis: Celery broker / results and the Channels layer ---------------------
PRIVATE_REDIS_SOCKET = DATA_DIR / "redis.sock"
REDIS_URL = os.environ.get("REDIS_URL") or f"unix://{PRIVATE_REDIS_SOCKET}?db=0"


def celery_url_from_redis_url(redis_url):
    """Returns the Celery (kombu) spelling of a Redis URL.

    redis:// and rediss:// are the same in both; a unix socket is unix:///path?db=N for
    redis-py and Channels but redis+socket:///path?virtual_host=N for kombu.
    """
    parsed = urlparse(redis_url)
    if parsed.scheme != "unix":
        return redis_url
    db = parse_qs(parsed.query).get("db", ["0"])[0]
    return f"redis+socket://{parsed.path}?virtual_host={db}"


CELERY_BROKER_URL = celery_url_from_redis_url(REDIS_URL)
# Celery's Redis result backend reads the same spelling as the broker.
CELERY_RESULT_BACKEND = CELERY_BROKER_URL
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_RESULT_EXPIRES = 3600
# Redis redelivers a task that its worker has not acknowledged within the visibility timeout
# (celery#5935, #3430): with acks_late that is every task still running, and every retry still
# waiting for its countdown, past the timeout. So the timeout must exceed the longest a task can
# hold its message: a tick, a move step and its retry countdown are seconds, and a stuck step ends
# at MERIDIAN_WORKFLOW_TIMEOUT_SECONDS. Recovering a crashed worker's tasks does not depend on it:
# the tick comes back from beat, and moves_sweep re-enqueues a lost move chain within seconds (a new
# chain id supersedes the old). So it is set long (an hour, and at least 4 workflow timeouts), and
# a redelivery that happens anyway is harmless: every move task is idempotent
# (tests/jobs/test_redelivery.py).
CELERY_VISIBILITY_TIMEOUT_SECONDS = _env_float("MERIDIAN_CELERY_VISIBILITY_TIMEOUT_SECONDS", 3600.0, minimum=60.0)
# --- control loop ---------------------------------------------------------------------
# Scheduling policy (jobs.snapshot.policy_settings): short times for tests and the demo.
MERIDIAN_MIN_RUN_SECONDS = _env_float("MERIDIAN_MIN_RUN_SECONDS", 600.0, minimum=0.0)
MERIDIAN_STANDARD_SLA_FLOOR = _env_float("MERIDIAN_STANDARD_SLA_FLOOR", 0.70)
# A job is not grown again sooner than this after a resize.
MERIDIAN_MIN_RESIZE_INTERVAL_SECONDS = _env_float("MERIDIAN_MIN_RESIZE_INTERVAL_SECONDS", 600.0, minimum=0.0)
# Free devices per region and type kept for Premium jobs.
MERIDIAN_PREMIUM_RESERVE_DEVICES = _env_int("MERIDIAN_PREMIUM_RESERVE_DEVICES", 0, minimum=0)
# Share of a type's devices, held by the jobs with the most work done, that only Premium may take.
MERIDIAN_PROTECTED_PROGRESS_SHARE = _env_float("MERIDIAN_PROTECTED_PROGRESS_SHARE", 0.25, minimum=0.0)
if MERIDIAN_PROTECTED_PROGRESS_SHARE > 1.0:
    raise ImproperlyConfigured(f"MERIDIAN_PROTECTED_PROGRESS_SHARE={os.environ['MERIDIAN_PROTECTED_PROGRESS_SHARE']!r} "
                               "must be a share between 0 and 1")
# A Premium job that finds no packed place (one node, else one rack, ...) even by preempting waits
# for one ("0", the default: spread out it runs at ~0.9 speed, below its SLA) or runs spread ("1").
MERIDIAN_PACKED_TIERS_MAY_SPREAD = _env_choice("MERIDIAN_PACKED_TIERS_MAY_SPREAD", "0", choices=("0", "1")) == "1"
# How far one job's ranks may spread at most: "node", "rack", "cluster" or "region" (the default:
# topology decides; the core packs a gang onto the tightest level that fits, one node first, and a
# job bigger than a node runs one meridian-run per host: runtime/multihost.py).
MERIDIAN_JOB_MAX_SPREAD = _env_choice("MERIDIAN_JOB_MAX_SPREAD", "region",
                                      choices=("node", "rack", "cluster", "region"))
# Whether a job may ask for the node's network (network "host": it reaches what the node reaches, its
# loopback services too: the database, the broker) instead of a namespace of its own with only
# loopback (runtime/netns.py). "deny" (the default) refuses such a submission with a 400 naming this
# setting; "allow" grants it (a team that must download its data from inside the job).
MERIDIAN_JOB_HOST_NETWORK = _env_choice("MERIDIAN_JOB_HOST_NETWORK", "deny", choices=("deny", "allow"))
# The largest world size (W, logical ranks) a job may ask for. A job costs W Replica rows, written
# again at every placement; a W the fleet could never run is refused (jobs.services.job_world_size_limits).
MERIDIAN_MAX_WORLD_SIZE = _env_int("MERIDIAN_MAX_WORLD_SIZE", 4096, minimum=1)
# Bulk submissions (POST /api/jobs/bulk/, meridian submit --array): at most this many jobs, and
# this many ranks in all (each rank is a Replica row written in the request).
MERIDIAN_MAX_BULK_JOBS = _env_int("MERIDIAN_MAX_BULK_JOBS", 1000, minimum=1)
# POST /api/jobs/ by API token answered before Django and DRF when it certainly can be
# (jobs/submit_api.py: same answers, ~a tenth of the CPU); 0 sends every submission through Django.
MERIDIAN_SUBMIT_FAST_PATH = _env_int("MERIDIAN_SUBMIT_FAST_PATH", 1, minimum=0) == 1
# POST /api/agent/heartbeat/ with a node token and a well-formed Heartbeat answered before Django and
# DRF (jobs/heartbeat_api.py: the same answer, without the middleware, DRF and a connection checkout
# per request); 0 sends every heartbeat through Django.
MERIDIAN_HEARTBEAT_FAST_PATH = _env_int("MERIDIAN_HEARTBEAT_FAST_PATH", 1, minimum=0) == 1
# How a full heartbeat's report is recorded (jobs/heartbeat_fold.py): "async" queues it (Redis) and
# answers at once, the folder (jobs.tasks.heartbeats_fold, every MERIDIAN_HEARTBEAT_FOLD_SECONDS)
# records the queue in batches, and a report is answered "deferred" until the folder decided it;
# "sync" records it in the request (what every heartbeat did before). With Redis unreachable, or
# more than MERIDIAN_HEARTBEAT_FOLD_BACKLOG heartbeats waiting, "async" records in the request too.
# "async" is the default since session 22: the chaos soak's CI version, the e2e control loop and the
# browser live pages pass with it, and it costs 10-33% less control-plane CPU per beat (docs/results.md).
MERIDIAN_HEARTBEAT_FOLD = _env_choice("MERIDIAN_HEARTBEAT_FOLD", "async", choices=("sync", "async"))
MERIDIAN_HEARTBEAT_FOLD_SECONDS = _env_float("MERIDIAN_HEARTBEAT_FOLD_SECONDS", 1.0, minimum=0.1)
MERIDIAN_HEARTBEAT_FOLD_BACKLOG = _env_int("MERIDIAN_HEARTBEAT_FOLD_BACKLOG", 50_000, minimum=1)
# The fast path's statements are prepared on the server once per connection (jobs.bulk.cursor_prepared);
# 0 for an external pooler in transaction mode that cannot carry them (PgBouncer before 1.21).
MERIDIAN_DB_PREPARED_STATEMENTS = _env_int("MERIDIAN_DB_PREPARED_STATEMENTS", 1, minimum=0) == 1
MERIDIAN_MAX_BULK_RANKS = _env_int("MERIDIAN_MAX_BULK_RANKS", 100_000, minimum=1)
# How many of a job's ranks may share one device when it is spliced onto fewer devices than W:
# W <= min_devices * this (min_devices counts against the team's quota).
MERIDIAN_MAX_RANKS_PER_DEVICE = _env_int("MERIDIAN_MAX_RANKS_PER_DEVICE", 64, minimum=1)
# A node whose agent missed heartbeats this long is lost (jobs.services.node_lost_sweep).
MERIDIAN_NODE_LOST_AFTER_SECONDS = _env_float("MERIDIAN_NODE_LOST_AFTER_SECONDS", 30.0, minimum=0.0)
# Device-time is accrued at most this often (jobs.accounting.accounting_run).
MERIDIAN_ACCOUNTING_SECONDS = _env_float("MERIDIAN_ACCOUNTING_SECONDS", 10.0, minimum=0.0)
# A move's step (or a stuck workflow) that takes longer than this is ended (jobs.moves).
MERIDIAN_WORKFLOW_TIMEOUT_SECONDS = _env_float("MERIDIAN_WORKFLOW_TIMEOUT_SECONDS", 300.0, minimum=0.0)
# Countdown of a move step task's retry while its step is not observed yet.
MERIDIAN_MOVE_POLL_SECONDS = _env_float("MERIDIAN_MOVE_POLL_SECONDS", 1.0, minimum=0.0)
# The shared checkpoint store every node and the control plane see.
MERIDIAN_CHECKPOINT_STORE = os.environ.get("MERIDIAN_CHECKPOINT_STORE") or str(DATA_DIR / "checkpoints")
# Live logs (jobs/logs.py): chunks older than this are pruned (on write, at most once a minute);
# a job keeps at most this many chunks (the oldest output goes first).
MERIDIAN_LOG_RETENTION_DAYS = _env_float("MERIDIAN_LOG_RETENTION_DAYS", 30.0, minimum=0.0)
MERIDIAN_LOG_MAX_CHUNKS_PER_JOB = _env_int("MERIDIAN_LOG_MAX_CHUNKS_PER_JOB", 20000, minimum=1)
# Code bundles (jobs/bundles.py): kept under <store>/bundles/; the largest upload accepted,
# and what one may unpack to (files and bytes); the workspace quota of each job.
MERIDIAN_BUNDLE_MAX_BYTES = _env_int("MERIDIAN_BUNDLE_MAX_BYTES", 256 << 20, minimum=1)
MERIDIAN_BUNDLE_MAX_UNPACKED_BYTES = _env_int("MERIDIAN_BUNDLE_MAX_UNPACKED_BYTES", 1 << 30, minimum=1)
MERIDIAN_BUNDLE_MAX_ENTRIES = _env_int("MERIDIAN_BUNDLE_MAX_ENTRIES", 20_000, minimum=1)
MERIDIAN_WORKSPACE_QUOTA_BYTES = _env_int("MERIDIAN_WORKSPACE_QUOTA_BYTES", 10 << 30, minimum=0)
# Garbage collection (jobs.bundles.artifacts_collect, beat and `manage.py artifacts_gc`): bundles
# no job references, this long after their upload; a job's saved outputs, this long after it ended.
# 0 keeps them for ever.
MERIDIAN_BUNDLE_GRACE_DAYS = _env_float("MERIDIAN_BUNDLE_GRACE_DAYS", 7.0, minimum=0.0)
MERIDIAN_OUTPUTS_RETENTION_DAYS = _env_float("MERIDIAN_OUTPUTS_RETENTION_DAYS", 30.0, minimum=0.0)
# A succeeded or cancelled job's checkpoint store, which its agent removes at once, is collected
# this long after the job ended when no agent did (at least twice MERIDIAN_NODE_LOST_AFTER_SECONDS;
# 0 keeps them); a failed job's after MERIDIAN_OUTPUTS_RETENTION_DAYS. The collection runs this often.
MERIDIAN_ENDED_STORE_GRACE_SECONDS = _env_float("MERIDIAN_ENDED_STORE_GRACE_SECONDS", 600.0, minimum=0.0)
MERIDIAN_ARTIFACTS_GC_SECONDS = _env_float("MERIDIAN_ARTIFACTS_GC_SECONDS", 600.0, minimum=1.0)
# Agents' liveness period, told to them at registration: every period an agent leases
# (POST /api/agent/lease/, fleet/lease_api.py: ~a Redis write), or sends a full heartbeat.
MERIDIAN_AGENT_HEARTBEAT_SECONDS = _env_float("MERIDIAN_AGENT_HEARTBEAT_SECONDS", 5.0, minimum=0.0)
# A full heartbeat (telemetry, progress, the desired state through Django) at least this often; sooner
# when the agent has a report that changed or the lease says its desired state changed. 30 s: the
# telemetry history's buckets are minutes (two readings each), progress is shown to people, and a
# sixth of the full heartbeats is a sixth of the agent API's CPU (the lease costs a small fraction).
MERIDIAN_AGENT_FULL_HEARTBEAT_SECONDS = _env_float("MERIDIAN_AGENT_FULL_HEARTBEAT_SECONDS", 30.0, minimum=0.0)
# fleet.tasks.leases_flush copies the leases (Redis) to Node.last_heartbeat this often, in one batch.
MERIDIAN_LEASE_FLUSH_SECONDS = _env_float("MERIDIAN_LEASE_FLUSH_SECONDS", 10.0, minimum=1.0)
# Each web process reloads its map of node-token digests this often: a revoked or rotated node token
# still leases for at most this long (full heartbeats and every other agent call refuse it at once).
MERIDIAN_LEASE_TOKEN_CACHE_SECONDS = _env_float("MERIDIAN_LEASE_TOKEN_CACHE_SECONDS", 10.0, minimum=0.0)
# The bootstrap token agents present to register; empty disables registration.
MERIDIAN_AGENT_ENROLLMENT_TOKEN = os.environ.get("MERIDIAN_AGENT_ENROLLMENT_TOKEN", "")
MERIDIAN_TICK_SECONDS = _env_float("MERIDIAN_TICK_SECONDS", 2.0, minimum=0.0)
CELERY_VISIBILITY_TIMEOUT_SECONDS = max(CELERY_VISIBILITY_TIMEOUT_SECONDS, 4 * MERIDIAN_WORKFLOW_TIMEOUT_SECONDS)
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": CELERY_VISIBILITY_TIMEOUT_SECONDS}
CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = {"visibility_timeout": CELERY_VISIBILITY_TIMEOUT_SECONDS}
CELERY_BEAT_SCHEDULE = {
    "scheduler-tick": {
        "task": "jobs.tasks.scheduler_tick",
        "schedule": MERIDIAN_TICK_SECONDS,
        # A tick that could not start before the next one is due is useless: drop it.
        "options": {"expires": MERIDIAN_TICK_SECONDS},
    },
    # Device-time accrual (attained / ideal), apart from the tick: jobs.accounting.accounting_run.
    "accounting": {"task": "jobs.tasks.accounting", "schedule": max(1.0, MERIDIAN_ACCOUNTING_SECONDS)},
    # Checkpoint rows beyond the newest few per job (the store keeps only those).
    "records-retention": {"task": "jobs.tasks.records_retention", "schedule": 600.0},
    # Unreferenced bundles, expired outputs, checkpoint stores no agent removed (jobs.bundles.artifacts_collect).
    "artifacts-gc": {"task": "jobs.tasks.artifacts_gc", "schedule": MERIDIAN_ARTIFACTS_GC_SECONDS,
                     "options": {"expires": MERIDIAN_ARTIFACTS_GC_SECONDS}},
    # Telemetry history: node minutes → cluster minutes and hours, retention (fleet.services).
    "telemetry-rollup": {"task": "fleet.tasks.telemetry_rollup", "schedule": 60.0, "options": {"expires": 60.0}},
    # Liveness leases (Redis) -> Node.last_heartbeat, one batched UPDATE (fleet.leases.leases_flush).
    "leases-flush": {"task": "fleet.tasks.leases_flush", "schedule": MERIDIAN_LEASE_FLUSH_SECONDS,
                     "options": {"expires": MERIDIAN_LEASE_FLUSH_SECONDS}},
    # Queued full heartbeats (MERIDIAN_HEARTBEAT_FOLD=async) recorded in batches (jobs/heartbeat_fold.py);
    # scheduled in "sync" too, so a queue left by an earlier "async" run is drained (one XLEN when empty).
    "heartbeats-fold": {"task": "jobs.tasks.heartbeats_fold", "schedule": MERIDIAN_HEARTBEAT_FOLD_SECONDS,
                        "options": {"expires": MERIDIAN_HEARTBEAT_FOLD_SECONDS}},
}

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL], "prefix": "meridian", "capacity": 1000, "expiry": 30},
    }
}

# --- metrics (portal.metrics, observability.metrics) ---------------------------------------------
# prometheus_client's multiprocess mode: every web process and Celery worker of this host writes
# its samples under one folder, read by /metrics. Set here, before any metric exists. Empty it when
# the whole stack (re)starts (counters otherwise carry on from the last run, which Prometheus' rate()
# takes in its stride; `./meridian run` starts each run with a fresh one).
METRICS_DIR = Path(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("MERIDIAN_METRICS_DIR")
                   or DATA_DIR / "metrics")
METRICS_DIR.mkdir(parents=True, exist_ok=True)
os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(METRICS_DIR)


def _metrics_token() -> str:
    """The operator token that opens /metrics: MERIDIAN_METRICS_TOKEN, or the first line of the file
    MERIDIAN_METRICS_TOKEN_FILE names; empty (metrics refused) when neither is set."""
    path = os.environ.get("MERIDIAN_METRICS_TOKEN_FILE", "").strip()
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as exc:
            raise ImproperlyConfigured(f"MERIDIAN_METRICS_TOKEN_FILE={path!r} cannot be read: {exc}") from None
    return os.environ.get("MERIDIAN_METRICS_TOKEN", "").strip()


MERIDIAN_METRICS_TOKEN = _metrics_token()

# --- auth -----------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# Brute-force protection of every password login (portal.auth): per account and per address.
AUTHENTICATION_BACKENDS = ["portal.auth.LoginThrottleBackend", "django.contrib.auth.backends.ModelBackend"]
MERIDIAN_LOGIN_FAILURE_LIMIT = _env_int("MERIDIAN_LOGIN_FAILURE_LIMIT", 5, minimum=1)
MERIDIAN_LOGIN_LOCKOUT_MINUTES = _env_float("MERIDIAN_LOGIN_LOCKOUT_MINUTES", 15.0, minimum=1 / 60)
AXES_ENABLED = True
# read at call time (portal.auth), so tests and operators change the MERIDIAN_ settings only
AXES_FAILURE_LIMIT = "portal.auth.login_failure_limit"
AXES_COOLOFF_TIME = "portal.auth.login_lockout_time"
AXES_LOCKOUT_PARAMETERS = ["ip_address", "username"]  # either one locks: an account, or an address
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "portal.auth.lockout_response"
AXES_VERBOSE = False
# Behind a reverse proxy every client has the proxy's address: set AXES_IPWARE_PROXY_COUNT and
# AXES_IPWARE_META_PRECEDENCE_ORDER there (see the operator guide), or every user shares one count.
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "login"

# --- REST API ---------------------------------------------------------------------
# Bodies above this size get a 413 with a message, never a 500 (see portal.api_errors).
DATA_UPLOAD_MAX_MEMORY_SIZE = _env_int("MERIDIAN_MAX_BODY_BYTES", 256 * 1024, minimum=1)
REST_FRAMEWORK = {
    # Token first: DRF answers an anonymous call with the first class's challenge, and only token
    # authentication has one (401 with WWW-Authenticate: Token; session-only would be a 403).
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": ["portal.api_errors.BoundedJSONParser"],
    "DEFAULT_PAGINATION_CLASS": "fleet.pagination.MeridianPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "portal.api_errors.exception_handler",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Meridian API",
    "DESCRIPTION": "Submit, watch and steer deep-learning jobs on a preemptible, elastic fleet.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # every operation's 4xx answers (portal.api_schema)
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "portal.api_schema.errors_documented"],
    "ENUM_NAME_OVERRIDES": {
        "AcceleratorTypeEnum": "fleet.accelerator_types.ACCELERATOR_TYPE_CHOICES",
        "JobStateEnum": "jobs.models.Job.State",
        "NodeStateEnum": "fleet.models.Node.State",
        "PreemptionStateEnum": "jobs.models.PreemptionRequest.State",
        "JobEventTypeEnum": "jobs.models.JobEvent.Type",
        "TierEnum": "jobs.models.Tier",
    },
}

# --- time, static ---------------------------------------------------------------------
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = BASE_DIR / "staticfiles"
MERIDIAN_SERVE_STATIC = os.environ.get("MERIDIAN_SERVE_STATIC", "1") == "1"

# Content-Security-Policy of every response (portal.middleware); empty turns it off.
MERIDIAN_CONTENT_SECURITY_POLICY = os.environ.get("MERIDIAN_CONTENT_SECURITY_POLICY", (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    "font-src 'self' data:; connect-src 'self' ws://{host} wss://{host}; object-src 'none'; base-uri 'self'; "
    "form-action 'self'; frame-ancestors 'none'"))

# --- production profile ------------------------------------------------------------------
if PRODUCTION:
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_SSL_REDIRECT = os.environ.get("SECURE_SSL_REDIRECT", "1") == "1"
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_HSTS_SECONDS = _env_int("SECURE_HSTS_SECONDS", 31536000, minimum=0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_CONTENT_TYPE_NOSNIFF = True
    SESSION_COOKIE_HTTPONLY = True
    X_FRAME_OPTIONS = "DENY"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("MERIDIAN_LOG_LEVEL", "INFO")},
    # axes logs every login at INFO; failures and lockouts are WARNING
    "loggers": {"django.db.backends": {"level": "WARNING"}, "axes": {"level": "WARNING"}},
}
