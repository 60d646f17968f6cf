"""Bundles through the API: upload (idempotent by digest, bounded), submit with one, the agent's
fetch (only for a node the job is placed on), and a job's outputs as a download."""
import hashlib
import io
import json
import tarfile

import pytest
from rest_framework.test import APIClient

from fleet.models import Node
from fleet.services import fleet_generate, node_token_issue
from jobs.bundles import bundle_path, job_outputs_path
from jobs.models import Bundle, Job
from protocol.bundle import object_relpath, pack_bytes


@pytest.fixture(autouse=True)
def store(settings, tmp_path):
    settings.MERIDIAN_CHECKPOINT_STORE = str(tmp_path / "store")
    return tmp_path / "store"


def _bundle(content=b"print('train')\n"):
    body = pack_bytes({"train.py": content, "data/input.txt": b"1 2 3\n"})
    return body, hashlib.sha256(body).hexdigest()


def _put(client, sha, body):
    return client.put(f"/api/bundles/{sha}/", data=body, content_type="application/octet-stream")


def test_the_same_bundle_uploaded_twice_is_stored_once(api_client_for, alice, bob):
    body, sha = _bundle()
    first = _put(api_client_for(alice), sha, body)
    assert first.status_code == 201, first.content
    assert first.json()["created"] is True and first.json()["entries"] == 2
    path = bundle_path(sha)
    inode = path.stat().st_ino
    again = _put(api_client_for(alice), sha, body)
    by_bob = _put(api_client_for(bob), sha, body)
    assert (again.status_code, by_bob.status_code) == (200, 200)
    assert Bundle.objects.count() == 1 and path.stat().st_ino == inode
    assert set(Bundle.objects.get().uploaders.values_list("username", flat=True)) == {"alice", "bob"}
    assert len(list(path.parent.iterdir())) == 1  # no leftover temporary upload


def test_head_says_whether_you_uploaded_a_digest(api_client_for, alice, charlie):
    body, sha = _bundle()
    assert api_client_for(alice).head(f"/api/bundles/{sha}/").status_code == 404
    _put(api_client_for(alice), sha, body)
    assert api_client_for(alice).head(f"/api/bundles/{sha}/").status_code == 200
    # charlie knowing the digest gets nothing: he must upload the bytes himself
    assert api_client_for(charlie).head(f"/api/bundles/{sha}/").status_code == 404


def test_an_upload_above_the_limit_is_a_413_and_stores_nothing(api_client_for, alice, settings):
    settings.MERIDIAN_BUNDLE_MAX_BYTES = 100
    body, sha = _bundle(b"x" * 5000)
    response = _put(api_client_for(alice), sha, body)
    assert response.status_code == 413
    assert "larger than the limit of 100 bytes" in response.json()["detail"]
    assert not bundle_path(sha).exists() and Bundle.objects.count() == 0


def test_a_body_that_does_not_hash_to_the_url_is_a_400_naming_sha256(api_client_for, alice):
    body, sha = _bundle()
    response = _put(api_client_for(alice), "0" * 64, body)
    assert response.status_code == 400 and sha in response.json()["sha256"][0]
    assert _put(api_client_for(alice), "not-a-digest", body).status_code == 400


def test_a_malicious_archive_is_refused_at_upload(api_client_for, alice):
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as archive:
        info = tarfile.TarInfo("../../etc/cron.d/owned")
        info.size = 1
        archive.addfile(info, io.BytesIO(b"x"))
    body = raw.getvalue()
    response = _put(api_client_for(alice), hashlib.sha256(body).hexdigest(), body)
    assert response.status_code == 400
    assert "'..' component" in response.json()["bundle"][0]


def test_submit_with_a_bundle_and_without_one(api_client_for, alice, charlie, job_spec):
    body, sha = _bundle()
    _put(api_client_for(alice), sha, body)
    with_bundle = api_client_for(alice).post("/api/jobs/", job_spec(bundle=sha), format="json")
    assert with_bundle.status_code == 201, with_bundle.content
    assert with_bundle.json()["bundle"] == sha
    without = api_client_for(alice).post("/api/jobs/", job_spec(), format="json")
    assert without.status_code == 201 and without.json()["bundle"] is None
    # a digest charlie did not upload is refused, naming the field
    refused = api_client_for(charlie).post("/api/jobs/", job_spec(bundle=sha, team="team-b"), format="json")
    assert refused.status_code == 400 and "upload it first" in refused.json()["bundle"][0]
    outside = api_client_for(alice).post("/api/jobs/", job_spec(bundle=sha, entrypoint="../x.py"), format="json")
    assert outside.status_code == 400 and "inside it" in outside.json()["entrypoint"][0]


def _placed_job(alice, sha, job_spec):
    from jobs.services import job_submit
    fleet_generate(regions=1, clusters=1, nodes=2, devices=4, accelerator_type="CPU", prefix="t")
    first, second = Node.objects.order_by("id")[:2]
    job = job_submit(team=alice.memberships.first().team, submitted_by=alice,
                     spec=job_spec(bundle=Bundle.objects.get(sha256=sha)))
    # Placement as a tick would leave it: every rank on the first node's devices (set directly:
    # the tick is not what is under test here).
    devices = list(first.accelerators.order_by("index")[:2])
    for replica in job.replicas.all():
        replica.device = devices[replica.rank % 2]
        replica.save()
    Job.objects.filter(pk=job.pk).update(state=Job.State.RUNNING)
    return job, first, second


def test_the_agent_fetches_a_bundle_only_for_a_job_placed_on_its_node(api_client_for, alice, job_spec):
    body, sha = _bundle()
    _put(api_client_for(alice), sha, body)
    job, placed, other = _placed_job(alice, sha, job_spec)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Node {node_token_issue(node=placed)}")
    response = client.get(f"/api/agent/bundles/{sha}/")
    assert response.status_code == 200 and b"".join(response.streaming_content) == body
    client.credentials(HTTP_AUTHORIZATION=f"Node {node_token_issue(node=other)}")
    refused = client.get(f"/api/agent/bundles/{sha}/")
    assert refused.status_code == 404 and "no job placed on this node" in refused.json()["detail"]
    client.credentials()
    assert client.get(f"/api/agent/bundles/{sha}/").status_code in (401, 403)


def test_the_desired_state_carries_the_bundle_digest_and_outputs(api_client_for, alice, job_spec):
    from jobs.workflows import node_desired_state_build
    body, sha = _bundle()
    _put(api_client_for(alice), sha, body)
    job, placed, _ = _placed_job(alice, sha, job_spec)
    entry = node_desired_state_build(node=placed).jobs[0]
    assert (entry.bundle, entry.outputs) == (sha, str(job_outputs_path(job.pk)))


def test_outputs_download_serves_the_saved_workspace(api_client_for, alice, charlie, submit, team_a):
    job = submit(team_a, alice)
    assert api_client_for(alice).get(f"/api/jobs/{job.pk}/outputs/").status_code == 404
    folder = job_outputs_path(job.pk)
    content = b"accuracy 0.93\n"
    digest = hashlib.sha256(content).hexdigest()
    (folder / object_relpath(digest)).parent.mkdir(parents=True)
    (folder / object_relpath(digest)).write_bytes(content)
    (folder / "latest.json").write_text(json.dumps({"step": 7, "files": {
        "results": {"dir": True}, "results/metrics.txt": {"size": len(content), "sha256": digest, "mode": 0o644},
        "../escape": {"size": 1, "sha256": digest},  # a node's manifest is not trusted
        "gone.bin": {"size": 3, "sha256": "f" * 64, "mode": 0o644}}}))
    response = api_client_for(alice).get(f"/api/jobs/{job.pk}/outputs/")
    assert response.status_code == 200 and response["X-Meridian-Outputs-Step"] == "7"
    with tarfile.open(fileobj=io.BytesIO(b"".join(response.streaming_content)), mode="r:gz") as archive:
        names = archive.getnames()
        assert archive.extractfile("results/metrics.txt").read() == content
        assert b"gone.bin" in archive.extractfile("MERIDIAN-MISSING.txt").read()
    assert "../escape" not in names and "escape" not in names
    assert api_client_for(charlie).get(f"/api/jobs/{job.pk}/outputs/").status_code == 404
