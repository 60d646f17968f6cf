"""Job submissions per second through the REST API, side by side with Slurm's sbatch (issue 18).

    .venv/bin/python bench/submit_rate.py [--backends sqlite,postgres] [--jobs 1000]
        [--clients 1,8,32] [--web-processes 2]
        [--db postgres://postgres@127.0.0.1:5432/meridian_bench_submit] [--redis redis://127.0.0.1:6379/4]

Per backend (the embedded default, SQLite; and PostgreSQL), on a fresh database: --web-processes
web processes (uvicorn, portal.web_server) as the production profile runs them
(MERIDIAN_PROFILE=production, DEBUG off), all
accepting on one listening socket (the kernel spreads the connections), the real API and token
authentication. Then, per client count, --jobs `POST /api/jobs/` from that many client threads
(one keep-alive connection each): rate, p50 and p99 latency, errors (any answer but 201); and one
`POST /api/jobs/bulk/` of --jobs jobs (Slurm's --array). Jobs are held: no Celery worker or beat
runs, so no tick places them and they stay pending (sbatch --hold). The load average is printed:
the machine is shared, and the clients run on the same cores as the servers.

Slurm's row is its published figure from issue 18 (Slurm 22.05, the same kind of machine) unless
`sbatch` is on PATH, when the same number of `sbatch --hold --wrap true` runs are timed here.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.control_plane import ensure_database  # noqa: E402
from portal.web_server import web_server_argv  # noqa: E402

DEFAULT_DB = "postgres://postgres@127.0.0.1:5432/meridian_bench_submit"
DEFAULT_REDIS = "redis://127.0.0.1:6379/4"
# Issue 18, measured side by side on this kind of machine (1,000 sbatch --hold each).
SLURM_PUBLISHED = {1: (234.0, None), 8: (472.0, None), 32: (431.0, 141.0)}  # clients: (per s, p99 ms)
TEAM = "team-a"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", default="sqlite,postgres")
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--clients", default="1,8,32")
    p.add_argument("--web-processes", type=int, default=2)
    p.add_argument("--db", default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_DB))
    p.add_argument("--redis", default=os.environ.get("BENCH_REDIS_URL", DEFAULT_REDIS))
    p.add_argument("--code", default=str(ROOT),
                   help="the checkout whose code the web processes run (e.g. main's, for a before/after)")
    p.add_argument("--setup", metavar="TOKEN_FILE", help=argparse.SUPPRESS)  # internal: migrate, cast, token
    return p.parse_args()


def setup_database(token_file):
    """In the backend's environment: migrates, creates the demo cast with a quota that never binds,
    and writes alice's API token to `token_file` (mode 600; never on a command line)."""
    os.environ["DJANGO_SETTINGS_MODULE"] = "portal.settings"
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", "--noinput", verbosity=0)
    from rest_framework.authtoken.models import Token

    from jobs.demo_cast import cast_create
    from jobs.models import Team

    cast = cast_create()
    Team.objects.filter(slug=TEAM).update(quotas={"CPU": 10**12})
    token, _ = Token.objects.get_or_create(user=cast.alice)
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token.key)


def backend_env(backend, args, data_dir):
    env = {**os.environ, "MERIDIAN_DATA_DIR": str(data_dir), "REDIS_URL": args.redis,
           "MERIDIAN_PROFILE": "production", "ALLOWED_HOSTS": "127.0.0.1", "SECURE_SSL_REDIRECT": "0",
           "MERIDIAN_LOG_LEVEL": "WARNING"}
    env.pop("DATABASE_URL", None)
    if backend == "postgres":
        env["DATABASE_URL"] = args.db
    return env


def fresh_postgres(url):
    from urllib.parse import urlparse

    import psycopg

    parsed = urlparse(url)
    name = parsed.path.lstrip("/")
    admin = parsed._replace(path="/postgres").geturl().replace("postgres://", "postgresql://", 1)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'drop database if exists "{name}" with (force)')
    ensure_database(url)


def start_web(env, processes, data_dir, code):
    """Returns (the web processes, port): `processes` web servers (portal.web_server) on one listening socket."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    port = listener.getsockname()[1]
    log = open(data_dir / "web.log", "ab")
    servers = [subprocess.Popen(web_server_argv(bin_dir=pathlib.Path(sys.executable).parent, fd=listener.fileno()),
                                cwd=code, env=env, stdout=log, stderr=subprocess.STDOUT, pass_fds=[listener.fileno()])
               for _ in range(processes)]
    listener.close()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/api/teams/")
            if conn.getresponse().status in {200, 401, 403}:
                return servers, port
        except OSError:
            time.sleep(0.3)
    for server in servers:
        server.kill()
    raise RuntimeError(f"the web server did not start; see {data_dir / 'web.log'}")


def job_body(i, *, team=True):
    return {**({"team": TEAM} if team else {}), "name": f"bench-{i}", "tier": "basic", "accelerator_type": "CPU",
            "world_size": 1, "entrypoint": "train.py"}


def cpu_seconds(pids):
    """Returns the user + system CPU seconds the processes `pids` have used (from /proc)."""
    total = 0.0
    for pid in pids:
        try:
            fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def database_pids(url):
    """Returns the PostgreSQL backend pids serving the bench's database (their CPU is the
    database's share of a submission), or [] for SQLite (it runs inside the web processes)."""
    if not url:
        return []
    from urllib.parse import urlparse

    import psycopg

    parsed = urlparse(url)
    admin = parsed._replace(path="/postgres").geturl().replace("postgres://", "postgresql://", 1)
    try:
        with psycopg.connect(admin, autocommit=True) as conn:
            rows = conn.execute("select pid from pg_stat_activity where datname = %s", (parsed.path.lstrip("/"),))
            return [row[0] for row in rows.fetchall()]
    except psycopg.OperationalError as error:
        # e.g. "too many clients already": the code under test ran the server out of connections
        print(f"  cannot count the database's backends ({error}); their CPU is left out", file=sys.stderr)
        return []


def submit_round(port, token, n_jobs, clients):
    """Returns (per second, p50 ms, p99 ms, errors, first error) for n_jobs POSTs from `clients` threads."""
    headers = {"Authorization": f"Token {token}", "Content-Type": "application/json"}
    latencies: list[float] = []
    errors: list[str] = []
    counter = iter(range(n_jobs))
    lock = threading.Lock()

    def client():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        mine, failed = [], []
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                break
            body = json.dumps(job_body(i))
            started = time.perf_counter()
            try:
                conn.request("POST", "/api/jobs/", body=body, headers=headers)
                response = conn.getresponse()
                text = response.read()
                if response.status != 201:
                    failed.append(f"{response.status} {text[:200]!r}")
            except (OSError, http.client.HTTPException) as error:
                failed.append(repr(error))
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            mine.append(time.perf_counter() - started)
        with lock:
            latencies.extend(mine)
            errors.extend(failed)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return n_jobs / elapsed, 1000 * statistics.median(latencies), 1000 * p99, len(errors), (errors or [""])[0]


def bulk_round(port, token, n_jobs):
    """Returns (seconds, status, jobs created) for one POST /api/jobs/bulk/ of n_jobs jobs."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = json.dumps({"team": TEAM, "jobs": [job_body(i, team=False) for i in range(n_jobs)]})
    started = time.perf_counter()
    conn.request("POST", "/api/jobs/bulk/", body=body,
                 headers={"Authorization": f"Token {token}", "Content-Type": "application/json"})
    response = conn.getresponse()
    payload = response.read()
    elapsed = time.perf_counter() - started
    created = len(json.loads(payload).get("jobs", [])) if response.status == 201 else 0
    return elapsed, response.status, created


def sbatch_round(n_jobs, clients):
    """Returns (per second, p99 ms) for n_jobs `sbatch --hold` runs from `clients` threads."""
    latencies: list[float] = []
    lock = threading.Lock()
    counter = iter(range(n_jobs))

    def client():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            started = time.perf_counter()
            subprocess.run(["sbatch", "--hold", "-J", f"bench-{i}", "--wrap", "true"], check=True, capture_output=True)
            with lock:
                latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    latencies.sort()
    return n_jobs / (time.perf_counter() - started), 1000 * latencies[int(0.99 * (len(latencies) - 1))]


def slurm_rows(n_jobs, client_counts):
    """Returns {clients: (per s, p99 ms or None, where from)}: timed here when sbatch exists."""
    if not shutil.which("sbatch"):
        return {c: (*SLURM_PUBLISHED[c], "issue 18") for c in client_counts if c in SLURM_PUBLISHED}
    return {clients: (*sbatch_round(n_jobs, clients), "sbatch here") for clients in client_counts}


def main():
    args = parse_args()
    if args.setup:
        setup_database(args.setup)
        return
    client_counts = [int(c) for c in args.clients.split(",") if c.strip()]
    table = []
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        with tempfile.TemporaryDirectory(prefix=f"meridian-submit-{backend}-") as tmp:
            data_dir = pathlib.Path(tmp)
            env = backend_env(backend, args, data_dir)
            if backend == "postgres":
                fresh_postgres(args.db)
            token_file = data_dir / "token"
            setup = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                     f"from bench.submit_rate import setup_database; setup_database({str(token_file)!r})"]
            subprocess.run(setup, cwd=args.code, env=env, check=True)
            token = token_file.read_text().strip()
            servers, port = start_web(env, args.web_processes, data_dir, args.code)
            web_pids = [server.pid for server in servers]
            try:
                for clients in client_counts:
                    db_pids = database_pids(env.get("DATABASE_URL"))
                    web_before, db_before = cpu_seconds(web_pids), cpu_seconds(db_pids)
                    rate, p50, p99, errors, first_error = submit_round(port, token, args.jobs, clients)
                    # backends the pool opened during the round count too (from their start: an
                    # upper bound, as their CPU before the round was spent on this bench as well)
                    web_cpu = cpu_seconds(web_pids) - web_before
                    db_cpu = cpu_seconds(set(database_pids(env.get("DATABASE_URL")))) - db_before
                    table.append((backend, f"POST /api/jobs/ x{args.jobs}", clients, rate, p50, p99, errors,
                                  os.getloadavg()[0], 1000 * (web_cpu + db_cpu) / args.jobs,
                                  1000 * db_cpu / args.jobs, first_error))
                    print(f"  {backend} {clients} clients: {rate:.0f}/s p99 {p99:.0f} ms, {errors} errors",
                          file=sys.stderr)
                db_pids = database_pids(env.get("DATABASE_URL"))
                web_before, db_before = cpu_seconds(web_pids), cpu_seconds(db_pids)
                seconds, status, created = bulk_round(port, token, args.jobs)
                web_cpu = cpu_seconds(web_pids) - web_before
                db_cpu = cpu_seconds(set(database_pids(env.get("DATABASE_URL")))) - db_before
                table.append((backend, f"POST /api/jobs/bulk/ of {args.jobs}", 1, created / seconds if created else 0,
                              1000 * seconds, 1000 * seconds, 0 if status == 201 else 1, os.getloadavg()[0],
                              1000 * (web_cpu + db_cpu) / args.jobs, 1000 * db_cpu / args.jobs,
                              "" if status == 201 else f"HTTP {status}"))
            finally:
                for server in servers:
                    server.terminate()
                for server in servers:
                    server.wait(timeout=30)
    print(f"\n{args.web_processes} web processes (uvicorn) per backend; {os.cpu_count()} cores; "
          "jobs held (no tick runs)")
    print(f"code: {args.code}")
    print("cpu ms/job: the web processes' and the database backends' CPU per job (user + system): what a job")
    print("costs the servers whatever else the machine runs; 1000 / it is the jobs per second one core could take;")
    print("db ms/job: the PostgreSQL backends' part of it (SQLite runs inside the web processes)")
    print(f"{'backend':<9} {'what':<28} {'clients':>7} {'jobs/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6} "
          f"{'load1':>6} {'cpu ms/job':>10} {'db ms/job':>9} {'jobs/s/core':>11}")
    for backend, what, clients, rate, p50, p99, errors, load, cpu_ms, db_ms, first_error in table:
        per_core = 1000 / cpu_ms if cpu_ms > 0 else 0
        print(f"{backend:<9} {what:<28} {clients:>7} {rate:>8.0f} {p50:>8.1f} {p99:>8.1f} {errors:>6} {load:>6.2f}"
              f" {cpu_ms:>10.2f} {db_ms:>9.2f} {per_core:>11.0f}"
              + (f"  first error: {first_error}" if first_error else ""))
    for clients, (rate, p99, where) in slurm_rows(args.jobs, client_counts).items():
        print(f"{'slurm':<9} {'sbatch --hold (' + where + ')':<28} {clients:>7} {rate:>8.0f} {'':>8} "
              f"{(f'{p99:.1f}' if p99 else '-'):>8} {0:>6} {'':>6}")


if __name__ == "__main__":
    main()
