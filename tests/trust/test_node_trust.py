"""Issue 15, the node's side: trust nothing a node sends.

  * a report about a job is accepted only from the node holding the job's current placement
    generation (or the old copy of an active move off it); any other is refused with the same
    words whatever the job is, and changes nothing;
  * a checkpoint lies in that copy's own store folder and carries its manifest's digest, which the
    control plane records, sends with restore_from, and the agent and the runtime check before
    anything is loaded;
  * the enrollment token never takes over an enrolled node; enrollment tokens are scoped and
    expire; tokens stay off command lines and out of jobs' environments;
  * every number from a node is bounded by physics (and what is stored already cannot break a view).

Real services, real HTTP edge (DRF's test client), real runtime store and launcher; no mocks.
"""
import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone
from rest_framework.test import APIClient

from agent.embedded import embedded_processes
from agent.main import parse_args
from agent.node import NodeReconciler, RestoreRefused, seed_store
from fleet.models import Accelerator, Cluster, EnrollmentToken, Node, NodeTelemetryBucket, Region, TelemetryResolution
from fleet.services import enrollment_token_create, telemetry_bucket_start
from jobs.models import Checkpoint, Job
from jobs.services import job_submit
from jobs.tick import tick_run
from jobs.workflows import NOT_YOURS, job_store_uri, node_desired_state
from runtime.store import CheckpointStore, manifest_sha256

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENROLL = "trust-enrollment-token"
DEVICES = [{"type": "CPU"}]


@pytest.fixture(autouse=True)
def policy(settings, tmp_path):
    settings.MERIDIAN_AGENT_ENROLLMENT_TOKEN = ENROLL
    settings.MERIDIAN_MIN_RUN_SECONDS = 0.0
    settings.MERIDIAN_CHECKPOINT_STORE = str(tmp_path / "store")


def register(hostname, *, enroll=ENROLL, region="eu", cluster="c1", devices=DEVICES, scheme="Enroll"):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"{scheme} {enroll}")
    return client.post("/api/agent/register/", {"hostname": hostname, "region": region, "cluster": cluster,
                                                "devices": devices}, format="json")


def as_node(token):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Node {token}")
    return client


def beat(node, *jobs, telemetry=None):
    body = {"jobs": list(jobs)}
    if telemetry is not None:
        body["telemetry"] = telemetry
    return node.post("/api/agent/heartbeat/", body, format="json")


def running_job(team, user, job_spec, name="team-a-secret-project"):
    """Returns (job, the token of the node it runs on, the other node's token): two one-device nodes."""
    a, b = register("node-a").json()["token"], register("node-b").json()["token"]
    job = job_submit(team=team, submitted_by=user, spec=job_spec(name=name, world_size=1, min_devices=1,
                                                                 tier="basic"))
    tick_run()
    job.refresh_from_db()
    holder = Node.objects.get(accelerators__replicas__job=job)
    return job, (a, b) if holder.hostname == "node-a" else (b, a)


def checkpoint_in(store, step, *, digest="cd" * 32):
    return {"step": step, "uri": f"file://{store}/ckpt-{step:012d}-1", "bytes": 10, "engine": "framework",
            "sha256": digest}


# --- Critical 1 (a): reports only from the holder of the current generation ----------------------------------


@pytest.mark.django_db
def test_a_node_cannot_plant_a_checkpoint_in_a_job_running_on_another_node(alice, team_a, job_spec):
    job, (holder, attacker) = running_job(team_a, alice, job_spec)
    store = job_store_uri(job.pk, generation=job.generation)

    # The reproduction of issue 15: a "stopped" report with a checkpoint, from a node that does not hold the job.
    answer = beat(as_node(attacker), {"job_id": job.pk, "generation": job.generation, "state": "stopped",
                                      "step": 999999, "checkpoint": checkpoint_in(store, 999999)}).json()

    assert answer["accepted"] == [] and answer["rejected"] == [
        {"job_id": job.pk, "error": NOT_YOURS.format(job_id=job.pk), "fence": True, "cancel": False}]
    job.refresh_from_db()
    assert job.last_checkpoint_step is None and not Checkpoint.objects.filter(job=job).exists()
    assert job.state == Job.State.SCHEDULED and job.progress_step == 0
    assert node_desired_state(node=Node.objects.get(accelerators__replicas__job=job))["jobs"][0]["restore_from"] is None


@pytest.mark.django_db
@pytest.mark.parametrize("state", ["running", "stopped", "failed", "finished"])
def test_a_report_on_another_nodes_job_changes_nothing_whatever_its_state(alice, team_a, job_spec, state):
    job, (holder, attacker) = running_job(team_a, alice, job_spec)

    answer = beat(as_node(attacker), {"job_id": job.pk, "state": state, "step": 5, "exit_code": 3,
                                      "error": "boom"}).json()

    assert answer["accepted"] == [] and answer["rejected"][0]["fence"] is True
    job.refresh_from_db()
    assert job.state == Job.State.SCHEDULED and job.exit_code is None and job.progress_step == 0


@pytest.mark.django_db
def test_a_rejection_tells_a_node_nothing_about_jobs_that_are_not_its_own(alice, team_a, job_spec):
    job, (holder, attacker) = running_job(team_a, alice, job_spec)
    missing = job.pk + 1000

    answer = beat(as_node(attacker), {"job_id": job.pk, "state": "running", "generation": 7},
                  {"job_id": missing, "state": "running", "generation": 7}).json()

    errors = {r["job_id"]: (r["error"], r["fence"], r["cancel"]) for r in answer["rejected"]}
    # An existing job of another team on another node reads exactly like a job that does not exist.
    assert errors[job.pk] == (NOT_YOURS.format(job_id=job.pk), True, False)
    assert errors[missing] == (NOT_YOURS.format(job_id=missing), True, False)
    assert job.name not in json.dumps(answer) and "generation 1" not in json.dumps(answer)


@pytest.mark.django_db
def test_the_holder_of_the_current_generation_is_heard(alice, team_a, job_spec):
    job, (holder, attacker) = running_job(team_a, alice, job_spec)
    store = job_store_uri(job.pk, generation=job.generation)

    answer = beat(as_node(holder), {"job_id": job.pk, "generation": job.generation, "state": "running",
                                    "step": 40, "checkpoint": checkpoint_in(store, 40)}).json()

    assert answer["accepted"] == [job.pk], answer
    job.refresh_from_db()
    assert job.state == Job.State.RUNNING and job.last_checkpoint_step == 40
    assert Checkpoint.objects.get(job=job).sha256 == "cd" * 32


# --- Critical 1 (b): a checkpoint lies in its copy's own store folder --------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("where", ["other-job", "other-generation", "dot-dot", "nested", "not-a-checkpoint",
                                   "another-host", "another-scheme", "relative"])
def test_the_holder_cannot_record_a_checkpoint_outside_its_own_store_folder(alice, team_a, job_spec, where):
    job, (holder, _) = running_job(team_a, alice, job_spec)
    store = job_store_uri(job.pk, generation=job.generation)
    root = pathlib.Path(store).parent.parent
    name = "ckpt-000000000040-1"
    uri = {"other-job": f"file://{root}/job-{job.pk + 1}/g1/{name}",
           "other-generation": f"file://{job_store_uri(job.pk, generation=job.generation - 1)}/{name}",
           "dot-dot": f"file://{store}/../../job-{job.pk + 1}/g1/{name}",
           "nested": f"file://{store}/{name}/{name}",
           "not-a-checkpoint": f"file://{store}/MANIFEST.json",
           "another-host": f"file://evil.example.com{store}/{name}",
           "another-scheme": f"s3://bucket{store}/{name}",
           "relative": f"job-{job.pk}/g{job.generation}/{name}"}[where]

    answer = beat(as_node(holder), {"job_id": job.pk, "generation": job.generation, "state": "running", "step": 41,
                                    "checkpoint": {**checkpoint_in(store, 40), "uri": uri}}).json()

    assert answer["accepted"] == [] and answer["rejected"][0]["error"].startswith("checkpoint.uri: ")
    assert answer["rejected"][0]["fence"] is False  # its own job: refused, not killed
    job.refresh_from_db()
    assert not Checkpoint.objects.filter(job=job).exists() and job.progress_step == 0


@pytest.mark.django_db
def test_a_checkpoint_without_its_manifests_digest_is_refused(alice, team_a, job_spec):
    job, (holder, _) = running_job(team_a, alice, job_spec)
    store = job_store_uri(job.pk, generation=job.generation)
    checkpoint = checkpoint_in(store, 40)
    del checkpoint["sha256"]

    answer = beat(as_node(holder), {"job_id": job.pk, "generation": job.generation, "state": "running",
                                    "step": 40, "checkpoint": checkpoint}).json()

    assert answer["rejected"][0]["error"].startswith("checkpoint.sha256: is required")
    assert not Checkpoint.objects.filter(job=job).exists()


@pytest.mark.django_db
@pytest.mark.parametrize("digest", ["CD" * 32, "cd" * 31, "zz" * 32, "cd" * 32 + "\n"])
def test_a_digest_that_is_not_a_sha256_is_a_400_naming_the_field(alice, team_a, job_spec, digest):
    job, (holder, _) = running_job(team_a, alice, job_spec)
    store = job_store_uri(job.pk, generation=job.generation)

    response = beat(as_node(holder), {"job_id": job.pk, "state": "running",
                                      "checkpoint": checkpoint_in(store, 40, digest=digest)})

    assert response.status_code == 400 and list(response.json()) == ["jobs.0.checkpoint.sha256"]


# --- Critical 1 (c): the recorded digest pins every restore -------------------------------------------------------


def committed(store_folder, step, payload=b"weights"):
    """Returns a real committed checkpoint (runtime.store) in `store_folder`."""
    source = pathlib.Path(tempfile.mkdtemp(prefix="state-", dir="/tmp"))
    (source / "rank-0").mkdir()
    (source / "rank-0" / "state.pt").write_bytes(payload * 100)
    return CheckpointStore(store_folder).commit(source, step, "framework", meta={"world_size": 1})


@pytest.mark.django_db
def test_the_next_placement_restores_the_recorded_checkpoint_with_its_digest(alice, team_a, job_spec):
    job, (holder, _) = running_job(team_a, alice, job_spec)
    store = job_store_uri(job.pk, generation=job.generation)
    ref = committed(store, 40)
    digest = manifest_sha256(ref.path)
    beat(as_node(holder), {"job_id": job.pk, "generation": job.generation, "state": "running", "step": 40,
                           "checkpoint": {"uri": ref.uri, "step": 40, "bytes": ref.bytes, "sha256": digest}})

    entry = node_desired_state(node=Node.objects.get(accelerators__replicas__job=job))["jobs"][0]

    assert entry["restore_from"] == ref.uri and entry["restore_sha256"] == digest


def test_the_agent_refuses_to_seed_a_checkpoint_whose_manifest_changed_after_it_was_recorded(tmp_path):
    ref = committed(tmp_path / "job-1" / "g1", 40)
    recorded = manifest_sha256(ref.path)
    manifest = json.loads((ref.path / "MANIFEST.json").read_text())
    # Someone with write access to the store rewrites the checkpoint and its manifest consistently
    # (so the runtime's own per-file check alone would pass it).
    (ref.path / "rank-0" / "state.pt").write_bytes(b"planted" * 100)
    from runtime.store import sha256_file, write_manifest
    digest, size = sha256_file(ref.path / "rank-0" / "state.pt")
    write_manifest(ref.path, {"rank-0/state.pt": {"size": size, "sha256": digest}},
                   **{k: manifest[k] for k in ("step", "engine", "meta", "created_unix")})

    with pytest.raises(RestoreRefused, match="control plane recorded"):
        seed_store(tmp_path / "job-1" / "g2", ref.uri, recorded)
    with pytest.raises(RestoreRefused, match="no manifest digest"):
        seed_store(tmp_path / "job-1" / "g2", ref.uri, None)
    assert not list((tmp_path / "job-1" / "g2").glob("ckpt-*")) if (tmp_path / "job-1" / "g2").exists() else True
    # The checkpoint as it is now has another digest: seeding with that one works.
    assert seed_store(tmp_path / "job-1" / "g2", ref.uri, manifest_sha256(ref.path)).name == ref.path.name


def test_a_symlinked_checkpoint_folder_is_not_seeded(tmp_path):
    ref = committed(tmp_path / "job-2" / "g1", 40)
    link = tmp_path / "job-1" / "g1" / ref.path.name
    link.parent.mkdir(parents=True)
    link.symlink_to(ref.path)

    with pytest.raises(RestoreRefused, match="not a committed checkpoint"):
        seed_store(tmp_path / "job-1" / "g2", link.as_uri(), manifest_sha256(ref.path))


def test_the_reconciler_fails_a_copy_whose_restore_is_refused_and_starts_nothing(tmp_path):
    ref = committed(tmp_path / "store" / "job-9" / "g1", 40)
    node = NodeReconciler(tmp_path / "w", engine="framework", checkpoint_every_s=0, workload_root=ROOT)
    node.reconcile([{"job_id": 9, "action": "run", "generation": 2, "world_size": 1, "devices": 1,
                     "device_indices": [0], "entrypoint": "examples/train_mlp.py", "env": {},
                     "store": str(tmp_path / "store" / "job-9" / "g2"), "restore_from": ref.uri,
                     "restore_sha256": "ef" * 32}])

    (report,) = node.observed()
    assert report.state == "failed" and report.generation == 2
    assert "restore refused" in report.error and "control plane recorded" in report.error
    assert not (node.jobs[9].job_dir / "launcher.json").exists() and node.jobs[9].pid is None
    assert not list((tmp_path / "store" / "job-9" / "g2").glob("ckpt-*"))


def launcher(store, job_dir, *extra):
    return subprocess.run(
        [sys.executable, "-m", "runtime.launcher", "--ranks", "1", "--engine", "framework", "--job-dir", str(job_dir),
         "--store", str(store), "--resume", *extra, str(ROOT / "examples" / "train_mlp.py")],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)


def test_the_runtime_restores_only_the_checkpoint_with_the_recorded_manifest(tmp_path):
    store = tmp_path / "store"
    older = committed(store, 10, payload=b"older")
    committed(store, 20, payload=b"newer")  # the newest, but not the one recorded

    wrong = launcher(store, tmp_path / "a", "--restore-manifest-sha256", "ef" * 32)
    assert wrong.returncode == 2, wrong.stderr
    events = [json.loads(line) for line in (tmp_path / "a" / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "failed" and "control plane recorded" in events[-1]["error"]
    assert not any(e["event"] in ("started", "restored") for e in events)

    # Pinned to the older checkpoint, the store hands out that one (and checks every file of it).
    assert CheckpointStore(store).pinned(manifest_sha256(older.path)).step == 10
    assert launcher(store, tmp_path / "b", "--restore-manifest-sha256", "not-hex").returncode == 2


# --- High 2: enrollment never takes over a node ------------------------------------------------------------------


@pytest.mark.django_db
def test_the_enrollment_token_cannot_take_over_an_enrolled_node():
    token = register("node-a").json()["token"]

    takeover = register("node-a")

    assert takeover.status_code == 403 and "token" not in takeover.json()
    assert "fleet_node_token" in takeover.json()["detail"]
    assert as_node(token).get("/api/agent/desired/").status_code == 200  # the real agent is unaffected


@pytest.mark.django_db
def test_a_node_token_registers_only_its_own_node():
    a = register("node-a").json()["token"]
    register("node-b")

    assert register("node-b", enroll=a, scheme="Node").status_code == 403
    assert register("node-a", enroll="not-a-token", scheme="Node").status_code == 401
    again = register("node-a", enroll=a, scheme="Node", devices=[{"type": "CPU"}] * 2)
    assert again.status_code == 201 and again.json()["token"] == a
    assert Accelerator.objects.filter(node__hostname="node-a", healthy=True).count() == 2


@pytest.mark.django_db
def test_a_node_described_in_the_database_that_never_enrolled_may_enrol_once():
    region = Region.objects.create(name="eu")
    Node.objects.create(cluster=Cluster.objects.create(region=region, name="c1"), hostname="described")

    assert register("described").status_code == 201  # the embedded run's demo fleet enrols so
    assert register("described").status_code == 403


@pytest.mark.django_db
def test_re_enrolling_an_enrolled_node_is_an_admin_action():
    old = register("node-a").json()["token"]
    out = io.StringIO()

    call_command("fleet_node_token", "--allow-enrollment", "node-a", stdout=out)

    assert as_node(old).get("/api/agent/desired/").status_code == 401
    new = register("node-a")
    assert new.status_code == 201 and as_node(new.json()["token"]).get("/api/agent/desired/").status_code == 200
    issued = io.StringIO()
    call_command("fleet_node_token", "node-a", stdout=issued)
    assert as_node(json.loads(issued.getvalue())["node-a"]).get("/api/agent/desired/").status_code == 200
    assert register("node-a").status_code == 403


@pytest.mark.django_db
def test_a_scoped_enrollment_token_enrols_new_nodes_into_its_cluster_until_it_expires(settings):
    settings.MERIDIAN_AGENT_ENROLLMENT_TOKEN = ""
    out = io.StringIO()
    call_command("fleet_enrollment_token", "--cluster", "eu/c1", "--hours", "1", stdout=out, stderr=io.StringIO())
    token = out.getvalue().strip()

    assert register("n1", enroll=token).status_code == 201
    wrong_cluster = register("n2", enroll=token, cluster="c2")
    assert wrong_cluster.status_code == 403 and "eu/c1" in wrong_cluster.json()["detail"]
    row = EnrollmentToken.objects.get()
    assert row.nodes_enrolled == 1 and row.token_hash != token

    EnrollmentToken.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    assert "expired" in register("n3", enroll=token).json()["detail"]
    EnrollmentToken.objects.update(expires_at=timezone.now() + timedelta(hours=1), revoked_at=timezone.now())
    assert "revoked" in register("n3", enroll=token).json()["detail"]
    assert not Node.objects.filter(hostname__in=["n2", "n3"]).exists()


@pytest.mark.django_db
def test_enrollment_tokens_are_bounded_in_time():
    cluster = Cluster.objects.create(region=Region.objects.create(name="eu"), name="c1")
    from django.core.exceptions import ValidationError
    with pytest.raises(ValidationError):
        enrollment_token_create(cluster=cluster, expires_in=timedelta(days=31))


@pytest.mark.django_db
def test_the_unscoped_bootstrap_token_is_refused_in_production(settings):
    settings.PRODUCTION = True
    response = register("n1")
    assert response.status_code == 403 and "fleet_enrollment_token" in response.json()["detail"]


def test_tokens_are_never_taken_on_the_agents_command_line(tmp_path, monkeypatch, capsys):
    for flag in ("--enroll-token", "--token"):
        with pytest.raises(SystemExit):
            parse_args(["--control-plane", "http://cp", flag, "secret"])
        assert "not taken on the command line" in capsys.readouterr().err
    monkeypatch.setenv("MERIDIAN_AGENT_ENROLL_TOKEN", "from-env")
    assert parse_args(["--control-plane", "http://cp"]).enroll_token == "from-env"
    (tmp_path / "t").write_text("from-file\n")
    assert parse_args(["--control-plane", "http://cp", "--token-file", str(tmp_path / "t")]).token == "from-file"


def test_the_embedded_run_passes_the_enrollment_token_in_the_environment(tmp_path):
    processes = embedded_processes(python="python", url="http://cp", root=ROOT, data_dir=tmp_path,
                                   enrollment_token="s3cr3t-token", demo_workload=False)
    assert processes and all("s3cr3t-token" not in " ".join(p.argv) for p in processes)
    assert all(p.env == {"MERIDIAN_AGENT_ENROLL_TOKEN": "s3cr3t-token"} for p in processes)


def test_a_job_never_sees_the_agents_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("MERIDIAN_AGENT_TOKEN", "node-secret")
    monkeypatch.setenv("MERIDIAN_AGENT_ENROLL_TOKEN", "enroll-secret")
    monkeypatch.setenv("MERIDIAN_AGENT_ENROLLMENT_TOKEN", "enroll-secret")
    node = NodeReconciler(tmp_path / "w", engine="framework", checkpoint_every_s=0, workload_root=ROOT)
    try:
        node.reconcile([{"job_id": 3, "action": "run", "generation": 1, "world_size": 1, "devices": 1,
                         "device_indices": [0], "entrypoint": "examples/train_mlp.py",
                         "args": ["--epochs", "40", "--step-sleep", "0.05"], "env": {"MY_TOKEN_FOR_JOB": "kept"},
                         "store": str(tmp_path / "store" / "job-3" / "g1")}])
        environ = pathlib.Path(f"/proc/{node.jobs[3].pid}/environ").read_bytes().split(b"\0")
    finally:
        node.kill_all()
    names = {entry.split(b"=", 1)[0].decode() for entry in environ if entry}
    assert not names & {"MERIDIAN_AGENT_TOKEN", "MERIDIAN_AGENT_ENROLL_TOKEN", "MERIDIAN_AGENT_ENROLLMENT_TOKEN"}
    assert "PATH" in names
    # what the member gave the job still reaches it: through sandbox.json, never the launcher's own
    # environment (agent/sandbox.py; the ranks get it, tests/sandbox/test_isolation.py)
    assert "MY_TOKEN_FOR_JOB" in (node.jobs[3].job_dir / "sandbox.json").read_text()
    # The ranks' environment is an allowlist (runtime.sandbox.rank_environment): built from the job's
    # own env and the runtime's variables, never from the launcher's or the agent's environment.
    from runtime.sandbox import rank_environment
    ranks = rank_environment({"MY_TOKEN_FOR_JOB": "kept"}, home="/w", user="job", runtime={"RANK": "0"},
                             pythonpath=str(ROOT))
    assert not {n for n in ranks if n.startswith("MERIDIAN_AGENT_")} and ranks["MY_TOKEN_FOR_JOB"] == "kept"


# --- High 4 and Medium 6: every number from a node is checked ----------------------------------------------------


@pytest.mark.django_db
def test_unphysical_device_memory_is_a_400_and_the_utilization_view_stays_up(admin_client):
    token = register("node-a", devices=[{"type": "CPU"}] * 2).json()["token"]
    telemetry = {"utilization": 0.5, "devices": [{"index": 0, "utilization": 0.5, "memory_used_gb": 1e308},
                                                 {"index": 1, "utilization": 0.5, "memory_used_gb": 1e308}]}

    response = beat(as_node(token), telemetry=telemetry)

    assert response.status_code == 400 and list(response.json()) == ["telemetry.devices.0.memory_used_gb"]
    # What an older control plane stored from such a heartbeat (two devices' 1e308 summed) breaks no view.
    now = timezone.now()
    node = Node.objects.get(hostname="node-a")
    NodeTelemetryBucket.objects.create(node=node, resolution=TelemetryResolution.MINUTE, accelerator_type="CPU",
                                       bucket_start=telemetry_bucket_start(now, TelemetryResolution.MINUTE),
                                       heartbeats=1, device_samples=2, utilization_sum=1.0, utilization_max=0.5,
                                       memory_used_gb_sum=1e308, memory_used_gb_max=1e308)
    NodeTelemetryBucket.objects.create(node=node, resolution=TelemetryResolution.MINUTE, accelerator_type="CPU",
                                       bucket_start=telemetry_bucket_start(now, TelemetryResolution.MINUTE)
                                       - timedelta(minutes=1), heartbeats=1, device_samples=2, utilization_sum=1.0,
                                       utilization_max=0.5, memory_used_gb_sum=1e308, memory_used_gb_max=1e308)
    assert beat(as_node(token), telemetry={**telemetry, "devices": [
        {"index": 0, "utilization": 0.5, "memory_used_gb": 70.0}]}).status_code == 200
    for path in ("/api/fleet/utilization/", f"/api/fleet/utilization/?node={node.pk}"):
        view = admin_client.get(path)
        assert view.status_code == 200, view.content
        assert "Infinity" not in view.content.decode() and "1e+308" not in view.content.decode()


@pytest.mark.django_db
def test_an_infinite_speed_is_refused_and_the_job_list_stays_up(alice, team_a, job_spec, api_client_for):
    job, (holder, _) = running_job(team_a, alice, job_spec)
    client = as_node(holder)

    response = client.post("/api/agent/heartbeat/", data=(
        '{"jobs": [{"job_id": %d, "state": "running", "step": 3, "steps_per_s": Infinity}]}' % job.pk),
        content_type="application/json")

    assert response.status_code == 400 and list(response.json()) == ["jobs.0.steps_per_s"]
    assert api_client_for(alice).get("/api/jobs/").status_code == 200


def huge_job_body(job_id, **fields):
    return {"jobs": [{"job_id": job_id, "state": "running", **fields}]}


MALFORMED_HEARTBEATS = [
    ("job_id-string", {"jobs": [{"job_id": "abc", "state": "running"}]}, "jobs.0.job_id"),
    ("job_id-null", {"jobs": [{"job_id": None, "state": "running"}]}, "jobs.0.job_id"),
    ("job_id-1e400", '{"jobs": [{"job_id": 1e400, "state": "running"}]}', "jobs.0.job_id"),
    ("generation-1e400", '{"jobs": [{"job_id": 1, "state": "running", "generation": 1e400}]}', "jobs.0.generation"),
    ("checkpoint-list", huge_job_body(1, checkpoint=[1, 2]), "jobs.0.checkpoint"),
    ("checkpoint-string", huge_job_body(1, checkpoint="file:///x"), "jobs.0.checkpoint"),
    ("checkpoint-step-string", huge_job_body(1, checkpoint={"uri": "file:///x", "step": "abc"}),
     "jobs.0.checkpoint.step"),
    ("checkpoint-step-2^63", huge_job_body(1, checkpoint={"uri": "file:///x", "step": 2**63}),
     "jobs.0.checkpoint.step"),
    ("checkpoint-bytes-2^63", huge_job_body(1, checkpoint={"uri": "file:///x", "step": 1, "bytes": 2**63}),
     "jobs.0.checkpoint.bytes"),
    ("step-2^63", huge_job_body(1, step=2**63), "jobs.0.step"),
    ("steps_per_s-string", huge_job_body(1, steps_per_s="fast"), "jobs.0.steps_per_s"),
    ("steps_per_s-unphysical", huge_job_body(1, steps_per_s=1e300), "jobs.0.steps_per_s"),
    ("exit_code-string", huge_job_body(1, exit_code="abc"), "jobs.0.exit_code"),
    ("exit_code-huge", huge_job_body(1, exit_code=2**40), "jobs.0.exit_code"),
    ("telemetry-list", {"telemetry": [], "jobs": []}, "telemetry"),
    ("utilization-above-1", {"telemetry": {"utilization": 1.5}}, "telemetry.utilization"),
    ("memory-negative", {"telemetry": {"devices": [{"index": 0, "memory_used_gb": -1}]}},
     "telemetry.devices.0.memory_used_gb"),
    ("node-memory-1e308", {"telemetry": {"memory_used_gb": 1e308}}, "telemetry.memory_used_gb"),
    ("device-index-huge", {"telemetry": {"devices": [{"index": 2**40}]}}, "telemetry.devices.0.index"),
]


@pytest.mark.django_db
@pytest.mark.parametrize("body, field", [case[1:] for case in MALFORMED_HEARTBEATS],
                         ids=[case[0] for case in MALFORMED_HEARTBEATS])
def test_a_malformed_number_in_a_heartbeat_is_a_400_naming_it(body, field):
    token = register("node-a").json()["token"]
    client = as_node(token)
    before = Node.objects.get(hostname="node-a").last_heartbeat

    if isinstance(body, str):
        response = client.post("/api/agent/heartbeat/", data=body, content_type="application/json")
    else:
        response = client.post("/api/agent/heartbeat/", body, format="json")

    assert response.status_code == 400, response.content
    assert list(response.json()) == [field], response.json()
    assert Node.objects.get(hostname="node-a").last_heartbeat == before


MALFORMED_REGISTRATIONS = [
    ("memory-string", [{"type": "CPU", "memory_gb": "abc"}], "devices.0.memory_gb"),
    ("memory-1e400", '[{"type": "CPU", "memory_gb": 1e400}]', "devices.0.memory_gb"),
    ("memory-negative", [{"type": "CPU", "memory_gb": -5}], "devices.0.memory_gb"),
    ("memory-unphysical", [{"type": "CPU", "memory_gb": 1e6}], "devices.0.memory_gb"),
]


@pytest.mark.django_db
@pytest.mark.parametrize("devices, field", [case[1:] for case in MALFORMED_REGISTRATIONS],
                         ids=[case[0] for case in MALFORMED_REGISTRATIONS])
def test_a_malformed_number_in_a_registration_is_a_400_naming_it(devices, field):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Enroll {ENROLL}")
    if isinstance(devices, str):
        response = client.post("/api/agent/register/", content_type="application/json",
                               data='{"hostname": "n1", "devices": %s}' % devices)
    else:
        response = client.post("/api/agent/register/", {"hostname": "n1", "devices": devices}, format="json")

    assert response.status_code == 400, response.content
    assert list(response.json()) == [field]
    assert not Node.objects.filter(hostname="n1").exists()


@pytest.mark.django_db
def test_stored_unphysical_readings_are_forgotten_by_the_migration():
    import importlib

    from django.apps import apps
    forget_fleet = importlib.import_module("fleet.migrations.0003_trust_node").unphysical_telemetry_forgotten
    forget_jobs = importlib.import_module("jobs.migrations.0004_trust_node").unphysical_speeds_forgotten
    token = register("node-a").json()["token"]
    node = Node.objects.get(hostname="node-a")
    Accelerator.objects.filter(node=node).update(memory_used_gb=1e308, utilization=7.0)
    NodeTelemetryBucket.objects.create(node=node, resolution=TelemetryResolution.MINUTE, accelerator_type="CPU",
                                       bucket_start=timezone.now(), memory_used_gb_max=1e308, utilization_max=0.2)

    forget_fleet(apps, None)
    forget_jobs(apps, None)

    device = Accelerator.objects.get(node=node)
    assert device.memory_used_gb is None and device.utilization is None
    assert not NodeTelemetryBucket.objects.exists()
    assert token


def committed_against_a_base(store_folder):
    """Returns (base, later): two committed checkpoints of `store_folder`, the later one's
    manifest pinning the first as its base (as CRIU's page-deduplicated checkpoints do)."""
    from runtime.store import write_bases

    store = CheckpointStore(store_folder)
    base = committed(store.root, 1)
    staging = store.staging_dir()
    (staging / "rank-0").mkdir()
    (staging / "rank-0" / "state.pt").write_bytes(b"delta" * 100)
    write_bases(staging, [{"name": base.path.name, "manifest_sha256": manifest_sha256(base.path)}])
    return base, store.commit(staging, 51, "criu")


def test_a_checkpoint_stored_against_a_base_is_seeded_with_its_base_and_verifies_there(tmp_path):
    # CRIU checkpoints after the first store only the pages that differ from a base checkpoint
    # (runtime/criu_pages.py); the next generation's store must get the base too, pinned by the
    # checkpoint's manifest (an e2e preemption under CRIU failed on the missing base).
    base, later = committed_against_a_base(tmp_path / "job-1" / "g1")

    seeded = seed_store(tmp_path / "job-1" / "g2", later.uri, manifest_sha256(later.path))
    new = CheckpointStore(tmp_path / "job-1" / "g2")
    assert (new.root / base.path.name).is_dir()
    new.verify(new.pinned(manifest_sha256(later.path)))  # the base verifies beside it
    assert seeded.name == later.path.name


def test_a_checkpoint_whose_base_is_gone_or_altered_is_not_seeded(tmp_path):
    base, later = committed_against_a_base(tmp_path / "job-1" / "g1")
    digest = manifest_sha256(later.path)

    manifest = base.path / "MANIFEST.json"
    manifest.write_text(manifest.read_text().replace('"step": 1', '"step": 2'))
    with pytest.raises(RestoreRefused, match="control plane recorded|sha256"):
        seed_store(tmp_path / "job-1" / "g2", later.uri, digest)
    shutil.rmtree(base.path)
    with pytest.raises(RestoreRefused, match="not a committed checkpoint"):
        seed_store(tmp_path / "job-1" / "g3", later.uri, digest)
    for refused in ("g2", "g3"):
        assert not (tmp_path / "job-1" / refused / later.path.name).exists()
