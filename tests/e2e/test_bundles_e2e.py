"""End to end with only the CLI, as a user: `meridian login`, `meridian submit` from a project
folder (a training script that reads a relative data file and writes relative outputs), the job
preempted by a Premium job and resumed on the other node, `meridian wait`, `meridian download`:
the outputs written before the preemption and after it are there."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from harness import ROOT
from polling import poll

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def meridian(plane, *args, config, cwd, stdin=None, check=True):
    env = {**os.environ, "XDG_CONFIG_HOME": str(config), "PYTHONPATH": str(ROOT)}
    env.pop("MERIDIAN_URL", None)
    env.pop("MERIDIAN_TOKEN", None)
    result = subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=cwd, env=env, input=stdin,
                            capture_output=True, text=True, timeout=400)
    if check:
        assert result.returncode == 0, f"meridian {' '.join(args)}: {result.returncode}\n{result.stdout}\n" \
                                       f"{result.stderr}\n{plane.logs(tail=2000)}"
    return result


def rank_pids(plane, hostname, job_id):
    """The pids of the rank processes of `job_id`'s attempts on `hostname` (their progress.json)."""
    pids = set()
    for progress in (plane.agents[hostname][1] / "j").glob(f"{job_id}.*/progress.json"):
        pids |= set(json.loads(progress.read_text()).get("rank_pids") or [])
    return pids


def test_a_user_submits_a_folder_sees_it_preempted_and_resumed_elsewhere_and_downloads_its_outputs(stack, tmp_path):
    plane = stack()
    plane.start_agent("n1", devices=1)
    plane.start_agent("n2", devices=1)
    project = tmp_path / "my-project"
    shutil.copytree(ROOT / "examples" / "project", project)
    (project / "outputs").mkdir()
    (project / "outputs" / "stale.bin").write_bytes(b"x" * 1000)  # .meridianignore'd: not shipped
    config = tmp_path / "config"

    login = meridian(plane, "login", plane.url, "--username", "alice", "--password-stdin", config=config,
                     cwd=project, stdin="alice-demo-pass\n")
    assert "logged in" in login.stdout
    assert (config / "meridian" / "config.json").stat().st_mode & 0o777 == 0o600

    jobs = {}
    for name in ("basic-a", "basic-b"):
        answer = meridian(plane, "submit", "--json", "--name", name, "--tier", "basic", "--", "python", "train.py",
                          "--epochs", "8", "--step-sleep", "0.1", config=config, cwd=project)
        jobs[name] = json.loads(answer.stdout)["id"]
    second_upload = json.loads(answer.stdout)
    assert second_upload["uploaded"] is False  # the same folder: stored once, not sent again
    for job_id in jobs.values():
        poll(f"job {job_id} to run 20 steps", lambda j=job_id: plane.job(j)["progress_step"] >= 20,
             timeout=180, on_timeout=lambda: plane.diagnose(*jobs.values()))
    status = json.loads(meridian(plane, "status", "--json", config=config, cwd=project).stdout)
    assert {j["id"] for j in status} >= set(jobs.values())

    premium = plane.submit(name="premium", tier="premium", epochs=24, step_sleep=0.1)  # no bundle: on the node
    plane.wait_state(premium, "running", timeout=120)
    victims = [j for j in jobs.values() if plane.job(j)["preemption_count"] >= 1]
    assert len(victims) == 1, plane.diagnose(premium, *jobs.values())
    victim = victims[0]

    waited = meridian(plane, "wait", str(victim), "--timeout", "300", "--interval", "1", config=config,
                      cwd=project)
    assert waited.returncode == 0
    hosts = plane.nodes_of(victim)
    assert len(hosts) == 2 and hosts[0] != hosts[1], plane.diagnose(victim)

    dest = tmp_path / "downloaded"
    meridian(plane, "download", str(victim), str(dest), config=config, cwd=tmp_path)
    started = (dest / "outputs" / "started.txt").read_text()
    metrics = json.loads((dest / "outputs" / "metrics.json").read_text())
    assert metrics["epochs"] == 8 and (dest / "outputs" / "model.pt").stat().st_size > 0
    assert (dest / "data" / "points.csv").read_text() == (project / "data" / "points.csv").read_text()
    assert not (dest / "outputs" / "stale.bin").exists()
    # started.txt is written only when absent: the resumed copy on the other node found the one the
    # first copy wrote (restored with its workspace), so it names the first copy's process.
    first_pid = int(started.split("pid ")[1].split()[0])
    assert first_pid in rank_pids(plane, hosts[0], victim), (started, rank_pids(plane, hosts[0], victim))
    assert first_pid not in rank_pids(plane, hosts[1], victim)
    events = meridian(plane, "events", str(victim), config=config, cwd=project).stdout
    assert "preempted" in events

    # The premium job had no bundle: its entrypoint was on the node, and it said so.
    assert plane.job(premium)["bundle"] is None
    plane.wait_state(premium, "succeeded", timeout=300)


def test_the_demo_workload_ships_its_jobs_as_bundles_and_stops_after_n(stack):
    plane = stack()
    demo = subprocess.run([sys.executable, str(ROOT / "examples" / "demo_workload.py"), "--control-plane", plane.url,
                           "--jobs", "3"], cwd=ROOT, env={**plane.env}, capture_output=True, text=True, timeout=120)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert demo.stdout.count("[demo] submitted job") == 3 and demo.stdout.count("uploaded") == 1, demo.stdout
    body = plane.api("GET", "jobs/?page_size=50").json()
    jobs = body["results"]
    assert len(jobs) == 3 and len({j["bundle"] for j in jobs}) == 1 and jobs[0]["bundle"]
