"""The `meridian` subcommands: login, submit, status, events, cancel, download, wait; and for
global admins, drain and undrain (a node, by hostname or id).

Exit codes: 0 success; 1 an error (the message says which); 2 bad usage (argparse). `wait`
exits with the job's outcome: 0 succeeded, the job's exit code (or 1) when it failed,
4 cancelled, 124 when --timeout passed first.
"""
from __future__ import annotations

import argparse
import getpass
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from cli.client import Client, CliError, config_load, config_save, print_json, print_table
from cli.main import command
from protocol import bundle as bundle_format

TERMINAL = {"succeeded", "failed", "cancelled"}
EXIT_CANCELLED = 4
EXIT_TIMEOUT = 124
DOWNLOAD_MAX_BYTES = 64 << 30
DOWNLOAD_MAX_ENTRIES = 1_000_000


# --- login ----------------------------------------------------------------------------------------


def _login_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("control_plane", metavar="URL", help="the portal's URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--username", help="default: asked for")
    parser.add_argument("--password-stdin", action="store_true", help="read the password from stdin (scripts)")


@command("login", help="log in to a control plane and save the token (mode 600)", add_arguments=_login_arguments,
         login_required=False)
def login(args: argparse.Namespace, client: Client) -> int:
    url = args.control_plane.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise CliError(f"{url!r} is not a URL; give it as http://host:port or https://host")
    username = args.username or input("username: ").strip()
    password = sys.stdin.readline().rstrip("\n") if args.password_stdin else getpass.getpass("password: ")
    if not username or not password:
        raise CliError("a username and a password are needed")
    anonymous = Client(url, None)
    answer = anonymous.request("POST", "/api/auth/token/", data={"username": username, "password": password},
                               ok=(400,))
    if answer.status_code == 400:
        raise CliError(f"{url} refused the login for {username!r}: wrong username or password")
    token = anonymous._json(answer).get("token")
    if not token:
        raise CliError(f"{url} answered the login without a token")
    saved = config_load()
    path = config_save({**saved, "url": url, "token": token, "username": username})
    if args.json:
        print_json({"url": url, "username": username, "config": str(path)})
    else:
        print(f"logged in to {url} as {username}; token saved in {path}")
    return 0


# --- submit ---------------------------------------------------------------------------------------


def _env_pair(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--env wants KEY=VALUE, not {text!r}")
    key, value = text.split("=", 1)
    return key, value


def _submit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", help="job name (default: the project folder's name)")
    parser.add_argument("--team", help="team slug (needed when you are on several teams)")
    parser.add_argument("--tier", choices=["premium", "standard", "basic"], default="standard")
    parser.add_argument("--type", dest="accelerator_type", default="CPU", help="accelerator type (default CPU)")
    parser.add_argument("--ranks", type=int, default=1, help="world size W (logical ranks)")
    parser.add_argument("--min-devices", type=int, default=None, help="fewest devices (divides W; default 1)")
    parser.add_argument("--total-steps", type=int, default=None, help="steps the script will take (for progress)")
    parser.add_argument("--env", type=_env_pair, action="append", default=[], metavar="K=V")
    parser.add_argument("--if-resume-refused", choices=["fail", "restart"], default=None,
                        help="when the framework checkpoint engine refuses a resume because the re-run is not the "
                             "run that was cut (an unseeded script, the script's own snapshot logic): fail the job "
                             "(the server's default) or start the script again from scratch (said in its events)")
    parser.add_argument("--network", choices=["isolated", "host"], default=None,
                        help="the job's network: isolated (the server's default: loopback only, it reaches nothing "
                             "outside the job) or host (the node's network, e.g. to download data; refused unless "
                             "the operator set MERIDIAN_JOB_HOST_NETWORK=allow). A job spanning hosts gets the "
                             "node's network, said in its events")
    parser.add_argument("--array", type=int, default=None, metavar="N",
                        help="submit N copies at once (Slurm's --array), all or none; copy i is named NAME[i] and "
                             "gets MERIDIAN_ARRAY_TASK_ID=i in its environment")
    parser.add_argument("--include", action="append", default=[], metavar="GLOB", help="bundle an ignored file anyway")
    parser.add_argument("--exclude", action="append", default=[], metavar="GLOB", help="leave files out of the bundle")
    parser.add_argument("--dir", default=".", help="the project folder to bundle (default: the current one)")
    parser.add_argument("--max-bundle-bytes", type=int, default=bundle_format.DEFAULT_MAX_UNPACKED_BYTES,
                        help="refuse to bundle more than this (unpacked)")
    parser.add_argument("script", nargs=argparse.REMAINDER, metavar="-- python train.py ARGS",
                        help="what to run, after --")


def split_command(words: list[str]) -> tuple[str, list[str]]:
    """Returns (entrypoint, args) of `-- python train.py --lr 0.1`: the interpreter is dropped
    (meridian-run runs the script with the node's Python)."""
    words = list(words)
    if words[:1] == ["--"]:
        words = words[1:]
    if words and Path(words[0]).name.startswith("python"):
        words = words[1:]
    if not words:
        raise CliError("say what to run after --, e.g. meridian submit -- python train.py --epochs 3")
    return words[0], words[1:]


def bundle_upload(client: Client, archive: Path, sha256: str) -> bool:
    """Uploads the archive unless the control plane has it from you already; returns whether it sent it."""
    if client.head(f"/api/bundles/{sha256}/") == 200:
        return False
    with open(archive, "rb") as handle:
        client.request("PUT", f"/api/bundles/{sha256}/", data=handle,
                       headers={"Content-Type": "application/octet-stream"}, timeout=(10.0, 600.0))
    return True


@command("submit", help="bundle the project folder, upload it and submit a job running it",
         add_arguments=_submit_arguments)
def submit(args: argparse.Namespace, client: Client) -> int:
    project = Path(args.dir).resolve()
    entrypoint, script_args = split_command(args.script)
    if Path(entrypoint).is_absolute() or ".." in Path(entrypoint).parts:
        raise CliError(f"the script must be a path inside {project}, relative to it (not {entrypoint!r})")
    if not (project / entrypoint).is_file():
        raise CliError(f"{entrypoint} is not a file in {project}; run meridian submit from your project folder "
                       f"(or pass --dir)")
    with tempfile.TemporaryDirectory(prefix="meridian-bundle-") as scratch:
        archive = Path(scratch) / "bundle.tar.gz"
        try:
            sha256, size, files = bundle_format.pack(project, archive, include=args.include, exclude=args.exclude,
                                                     max_unpacked_bytes=args.max_bundle_bytes)
        except bundle_format.BundleError as exc:
            raise CliError(str(exc)) from None
        if not any(f.rel == Path(entrypoint).as_posix() for f in files):
            raise CliError(f"{entrypoint} is ignored (.gitignore / .meridianignore / --exclude), so the bundle would "
                           f"not hold it; pass --include {entrypoint}")
        began = time.monotonic()
        sent = bundle_upload(client, archive, sha256)
        upload_s = time.monotonic() - began
    spec = {"name": args.name or project.name, "tier": args.tier, "accelerator_type": args.accelerator_type,
            "world_size": args.ranks, "entrypoint": Path(entrypoint).as_posix(), "args": script_args,
            "env": dict(args.env), "bundle": sha256}
    if args.team:
        spec["team"] = args.team
    if args.min_devices is not None:
        spec["min_devices"] = args.min_devices
    if args.total_steps is not None:
        spec["total_steps"] = args.total_steps
    if args.if_resume_refused is not None:  # left out, an older control plane still takes the spec
        spec["if_resume_refused"] = args.if_resume_refused
    if args.network is not None:  # left out likewise
        spec["network"] = args.network
    if args.array is not None:
        return _submit_array(args, client, spec, sha256=sha256, size=size, files=len(files), sent=sent)
    job = client.post("/api/jobs/", spec)
    page = f"{client.url}/jobs/{job['id']}/"
    if args.json:
        print_json({"id": job["id"], "url": page, "state": job["state"], "bundle": sha256, "bundle_bytes": size,
                    "bundle_files": len(files), "uploaded": sent, "upload_seconds": round(upload_s, 3)})
    else:
        how = f"uploaded {bundle_format.human_bytes(size)}" if sent else "already uploaded"
        print(f"bundle {sha256[:12]} ({len(files)} files, {how})")
        print(f"submitted job {job['id']} ({job['name']}, {job['tier']}, W={job['world_size']}): {page}")
    return 0


ARRAY_TASK_ID = "MERIDIAN_ARRAY_TASK_ID"


def _submit_array(args: argparse.Namespace, client: Client, spec: dict, *, sha256: str, size: int, files: int,
                  sent: bool) -> int:
    """Submits args.array copies of `spec` in one POST /api/jobs/bulk/ (all or none); prints their ids."""
    if args.array < 1:
        raise CliError(f"--array wants a number of copies, 1 or more (not {args.array})")
    team = spec.pop("team", None)
    specs = [{**spec, "name": f"{spec['name']}[{i}]", "env": {**spec["env"], ARRAY_TASK_ID: str(i)}}
             for i in range(args.array)]
    answer = client.post("/api/jobs/bulk/", {**({"team": team} if team else {}), "jobs": specs})
    ids = [job["id"] for job in answer["jobs"]]
    if args.json:
        print_json({"ids": ids, "bundle": sha256, "bundle_bytes": size, "bundle_files": files, "uploaded": sent})
    else:
        how = f"uploaded {bundle_format.human_bytes(size)}" if sent else "already uploaded"
        print(f"bundle {sha256[:12]} ({files} files, {how})")
        print(f"submitted {len(ids)} jobs {ids[0]}..{ids[-1]} ({spec['name']}[0..{len(ids) - 1}], {spec['tier']}, "
              f"W={spec['world_size']})")
    return 0


# --- status, events, cancel -----------------------------------------------------------------------


def _job_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", type=int, help="job id")


def _status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", type=int, nargs="?", help="one job (default: your teams' unfinished jobs)")
    parser.add_argument("--all", action="store_true", help="include finished jobs")


def _progress(job: dict) -> str:
    step = job.get("progress_step") or 0
    total = job.get("total_steps")
    return f"{step}/{total}" if total else str(step)


def _why(job: dict) -> str:
    if job["state"] == "failed":
        return (job.get("failure_reason") or "").splitlines()[0][:60] if job.get("failure_reason") else ""
    return job.get("wait_reason") or ""


@command("status", help="a table of jobs (like squeue): state, devices, progress, place in line, why it waits",
         add_arguments=_status_arguments)
def status(args: argparse.Namespace, client: Client) -> int:
    if args.job is not None:
        jobs = [client.get(f"/api/jobs/{args.job}/")]
    else:
        jobs = [j for j in client.iter_pages("/api/jobs/", params={"page_size": 200})
                if args.all or j["state"] not in TERMINAL]
    if args.json:
        print_json(jobs if args.job is None else jobs[0])
        return 0
    rows = [[j["id"], j["name"][:28], j["team"]["slug"], j["tier"], j["state"],
             f"{j['device_count']}/{j['world_size']}", _progress(j), j.get("queue_position"), _why(j)]
            for j in jobs]
    if not rows:
        print("no unfinished jobs on your teams (meridian status --all shows finished ones)")
        return 0
    print_table(rows, ["ID", "NAME", "TEAM", "TIER", "STATE", "DEV/W", "STEP", "LINE", "WHY"])
    return 0


@command("events", help="a job's timeline, oldest first", add_arguments=_job_argument)
def events(args: argparse.Namespace, client: Client) -> int:
    found = list(client.iter_pages(f"/api/jobs/{args.job}/events/", params={"page_size": 500}))
    if args.json:
        print_json(found)
        return 0
    rows = [[e["created_at"][:19].replace("T", " "), e["type"],
             f"{e['from_state']}->{e['to_state']}" if e.get("to_state") else "", (e.get("reason") or "")[:70]]
            for e in found]
    print_table(rows, ["TIME", "EVENT", "STATE", "REASON"])
    return 0


@command("cancel", help="cancel a job", add_arguments=_job_argument)
def cancel(args: argparse.Namespace, client: Client) -> int:
    job = client.post(f"/api/jobs/{args.job}/cancel/")
    if args.json:
        print_json(job)
    else:
        print(f"job {job['id']} is {job['state']}")
    return 0


# --- wait, download -------------------------------------------------------------------------------


def _wait_arguments(parser: argparse.ArgumentParser) -> None:
    _job_argument(parser)
    parser.add_argument("--timeout", type=float, default=None, help="give up after this many seconds (exit 124)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between polls")


def job_exit_code(job: dict) -> int:
    if job["state"] == "succeeded":
        return 0
    if job["state"] == "cancelled":
        return EXIT_CANCELLED
    code = job.get("exit_code")
    return code if isinstance(code, int) and 0 < code < 256 else 1


@command("wait", help="wait until a job ends; the exit code is the job's", add_arguments=_wait_arguments)
def wait(args: argparse.Namespace, client: Client) -> int:
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    last_state = None
    while True:
        job = client.get(f"/api/jobs/{args.job}/")
        if job["state"] != last_state and not args.json:
            print(f"job {job['id']}: {job['state']}", file=sys.stderr)
            last_state = job["state"]
        if job["state"] in TERMINAL:
            break
        if deadline is not None and time.monotonic() > deadline:
            if args.json:
                print_json({"id": job["id"], "state": job["state"], "timed_out": True})
            print(f"meridian wait: job {job['id']} is still {job['state']} after {args.timeout:.0f} s",
                  file=sys.stderr)
            return EXIT_TIMEOUT
        time.sleep(args.interval)
    code = job_exit_code(job)
    if args.json:
        print_json({"id": job["id"], "state": job["state"], "exit_code": code,
                    "failure_reason": job.get("failure_reason") or None})
    elif job["state"] == "failed":
        print(f"job {job['id']} failed: {(job.get('failure_reason') or '').strip()[:2000]}", file=sys.stderr)
    return code


def _download_arguments(parser: argparse.ArgumentParser) -> None:
    _job_argument(parser)
    parser.add_argument("dest", nargs="?", help="a folder to unpack into (default ./job-<id>-outputs), "
                                                "or a file name ending in .tar.gz to keep the archive")


@command("download", help="download a job's outputs (its workspace as last saved)", add_arguments=_download_arguments)
def download(args: argparse.Namespace, client: Client) -> int:
    dest = Path(args.dest or f"job-{args.job}-outputs")
    keep_archive = dest.name.endswith((".tar.gz", ".tgz"))
    if not keep_archive and dest.exists() and any(dest.iterdir()):
        raise CliError(f"{dest} exists and is not empty; name a new folder (or a .tar.gz file)")
    with client.stream(f"/api/jobs/{args.job}/outputs/", timeout=(10.0, 600.0)) as response:
        which = response.headers.get("X-Meridian-Outputs", "")
        step = response.headers.get("X-Meridian-Outputs-Step")
        archive_dir = tempfile.mkdtemp(prefix="meridian-download-", dir=dest.parent if keep_archive else None)
        archive = Path(archive_dir) / "outputs.tar.gz"
        size = 0
        try:
            with open(archive, "wb") as out:
                for chunk in response.iter_content(1 << 20):
                    out.write(chunk)
                    size += len(chunk)
            if keep_archive:
                os.replace(archive, dest)
                summary = None
            else:
                try:
                    # The same checks as a bundle: a damaged or hostile archive writes nothing outside dest.
                    summary = bundle_format.unpack(archive, dest, max_entries=DOWNLOAD_MAX_ENTRIES,
                                                   max_bytes=DOWNLOAD_MAX_BYTES)
                except bundle_format.BundleError as exc:
                    raise CliError(f"the outputs archive was refused: {exc}") from None
        finally:
            shutil.rmtree(archive_dir, ignore_errors=True)
    source = "the job's end" if which == "final" else f"its newest checkpoint (step {step})"
    if args.json:
        print_json({"id": args.job, "dest": str(dest), "bytes": size, "source": which or None, "step": step,
                    "files": summary.entries if summary else None})
    else:
        print(f"job {args.job}'s outputs from {source}: {dest}" + (f" ({summary.entries} entries)" if summary else ""))
    if not keep_archive and (dest / "MERIDIAN-MISSING.txt").exists():
        print(f"warning: some files' saved copies were missing; see {dest / 'MERIDIAN-MISSING.txt'}", file=sys.stderr)
    return 0


# --- drain, undrain (global admins) ---------------------------------------------------------------


def node_resolve(client: Client, name: str) -> int:
    """Returns the id of the node named `name`: its hostname, else (all digits) its id."""
    found = client.get("/api/nodes/", params={"hostname": name})
    results = found.get("results", []) if isinstance(found, dict) else found
    if results:
        return int(results[0]["id"])
    if name.isascii() and name.isdigit():
        return int(name)
    raise CliError(f"no node named {name!r}; GET /api/nodes/ lists them (give a hostname or an id)")


def _node_line(node: dict) -> str:
    line = f"node {node['hostname']} (id {node['id']}) is {node['state']}"
    if node.get("drain_reason"):
        line += f": {node['drain_reason']} (by {node.get('drained_by') or '?'} at {node.get('drained_at')})"
    return line


def _drain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("node", metavar="NODE", help="hostname or id")
    parser.add_argument("--reason", required=True, help="why (the next operator reads it), e.g. 'replace GPU 3'")


@command("drain", help="drain a node (global admins): move its jobs off, place nothing new on it",
         add_arguments=_drain_arguments)
def drain(args: argparse.Namespace, client: Client) -> int:
    node_id = node_resolve(client, args.node)
    node = client.post(f"/api/nodes/{node_id}/drain/", {"reason": args.reason})
    if args.json:
        print_json(node)
        return 0
    print(_node_line(node))
    holding = node.get("jobs_holding_devices") or 0
    print(f"{holding} job(s) still hold devices there" + (": the scheduler moves them off" if holding else ""))
    return 0


def _undrain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("node", metavar="NODE", help="hostname or id")


@command("undrain", help="undrain a node (global admins): jobs may be placed on it again",
         add_arguments=_undrain_arguments)
def undrain(args: argparse.Namespace, client: Client) -> int:
    node = client.post(f"/api/nodes/{node_resolve(client, args.node)}/undrain/")
    if args.json:
        print_json(node)
    else:
        print(_node_line(node))
    return 0
