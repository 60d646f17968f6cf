"""The portal's submit form takes a code bundle too, through the same service as the API."""
import hashlib
import io
import tarfile

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.urls import reverse

from jobs.models import Bundle, Job
from protocol.bundle import pack_bytes


@pytest.fixture(autouse=True)
def store(settings, tmp_path):
    settings.MERIDIAN_CHECKPOINT_STORE = str(tmp_path / "store")


def _form(team, archive):
    return {"team": str(team.pk), "name": "from-the-form", "entrypoint": "train.py", "args": "--epochs 2",
            "world_size": 2, "min_devices": 1, "tier": "standard", "accelerator_type": "CPU", "env": "",
            "bundle": archive}


def _client(user):
    client = Client()
    client.force_login(user)
    return client


def test_the_form_submits_a_job_with_an_uploaded_bundle(alice, team_a):
    body = pack_bytes({"train.py": b"print(1)\n"})
    response = _client(alice).post(reverse("pages:job-submit"),
                                   _form(team_a, SimpleUploadedFile("p.tar.gz", body, "application/gzip")))
    assert response.status_code == 302, response.content.decode()[:2000]
    job = Job.objects.get(name="from-the-form")
    assert job.bundle.sha256 == hashlib.sha256(body).hexdigest() and Bundle.objects.count() == 1
    page = _client(alice).get(reverse("pages:job-detail", args=[job.pk])).content.decode()
    assert job.bundle.sha256[:12] in page and f"/api/jobs/{job.pk}/outputs/" in page


def test_a_malicious_upload_is_an_error_on_the_bundle_field(alice, team_a):
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as archive:
        info = tarfile.TarInfo("/etc/passwd")
        info.size = 1
        archive.addfile(info, io.BytesIO(b"x"))
    response = _client(alice).post(reverse("pages:job-submit"),
                                   _form(team_a, SimpleUploadedFile("p.tar.gz", raw.getvalue())))
    assert response.status_code == 200
    assert 'data-testid="error-bundle"' in response.content.decode() and "absolute path" in response.content.decode()
    assert not Job.objects.filter(name="from-the-form").exists()


def test_without_a_bundle_the_page_says_the_entrypoint_is_on_the_node(alice, team_a):
    form = _form(team_a, "")
    form.pop("bundle")
    response = _client(alice).post(reverse("pages:job-submit"), form)
    assert response.status_code == 302
    job = Job.objects.get(name="from-the-form")
    assert job.bundle is None
    page = _client(alice).get(reverse("pages:job-detail", args=[job.pk])).content.decode()
    assert "the entrypoint is on the node" in page
