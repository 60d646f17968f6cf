"""Garbage collection of the artifact store (jobs.bundles.artifacts_collect, run by Celery beat and
by `manage.py artifacts_gc`): bundles no job references after a grace period, the saved outputs of
jobs that ended after a retention, the checkpoint stores no agent removed; never what a live or a
recent job needs."""
import hashlib
import io
import os
import pathlib
from datetime import timedelta

import pytest
from django.conf import settings as django_settings
from django.core.management import call_command
from django.utils import timezone

from jobs.bundles import bundle_path, bundle_store, job_outputs_path
from jobs.models import Bundle, Job
from jobs.tasks import artifacts_gc
from jobs.workflows import job_store_uri
from protocol.bundle import pack_bytes

pytestmark = pytest.mark.django_db
DAY = timedelta(days=1)


@pytest.fixture(autouse=True)
def store(settings, tmp_path):
    settings.MERIDIAN_CHECKPOINT_STORE = str(tmp_path / "store")
    settings.MERIDIAN_BUNDLE_GRACE_DAYS = 7
    settings.MERIDIAN_OUTPUTS_RETENTION_DAYS = 30
    settings.MERIDIAN_ENDED_STORE_GRACE_SECONDS = 600
    settings.MERIDIAN_NODE_LOST_AFTER_SECONDS = 30
    return tmp_path / "store"


def uploaded(user, *, days_ago, content=b"print('train')\n"):
    body = pack_bytes({"train.py": content})
    bundle, _ = bundle_store(stream=io.BytesIO(body), sha256=hashlib.sha256(body).hexdigest(), user=user)
    Bundle.objects.filter(pk=bundle.pk).update(created_at=timezone.now() - days_ago * DAY)
    return bundle


def ended(job, *, days_ago, state=Job.State.SUCCEEDED):
    Job.objects.filter(pk=job.pk).update(state=state, finished_at=timezone.now() - days_ago * DAY)
    return job


def with_outputs(job_id):
    folder = job_outputs_path(job_id)
    (folder / "objects").mkdir(parents=True)
    (folder / "final.json").write_text('{"files": {}}')
    return folder


def age(path, *, days):
    stamp = (timezone.now() - days * DAY).timestamp()
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(item, (stamp, stamp))


def test_a_bundle_no_job_references_goes_after_the_grace_period_and_no_sooner(alice, submit, team_a):
    old = uploaded(alice, days_ago=8, content=b"old")
    recent = uploaded(alice, days_ago=1, content=b"recent")
    used = uploaded(alice, days_ago=400, content=b"used")
    ended(submit(team_a, alice, bundle=used), days_ago=400)  # a job names it: its copies may run again
    stray = bundle_path(old.sha256).parent / ".upload-interrupted"
    stray.write_bytes(b"half an upload")
    age(stray, days=8)

    deleted = artifacts_gc()

    assert deleted == {"bundles": 2, "outputs": 0, "stores": 0}
    assert not Bundle.objects.filter(pk=old.pk).exists() and not bundle_path(old.sha256).exists()
    assert not stray.exists()
    for kept in (recent, used):
        assert Bundle.objects.filter(pk=kept.pk).exists() and bundle_path(kept.sha256).is_file()


def test_the_outputs_of_a_job_that_ended_go_after_the_retention_never_a_live_or_recent_jobs(
        alice, submit, team_a, api_client_for):
    expired = ended(submit(team_a, alice), days_ago=31)
    recent = ended(submit(team_a, alice), days_ago=29, state=Job.State.FAILED)
    preempted = submit(team_a, alice)
    Job.objects.filter(pk=preempted.pk).update(state=Job.State.PREEMPTED)  # resumes with its outputs
    running = submit(team_a, alice)
    Job.objects.filter(pk=running.pk).update(state=Job.State.RUNNING)
    folders = {job.pk: with_outputs(job.pk) for job in (expired, recent, preempted, running)}
    for folder in folders.values():
        age(folder, days=90)  # old files: a live job's are kept whatever their age
    unknown = with_outputs(99999)
    age(unknown, days=31)

    assert artifacts_gc() == {"bundles": 0, "outputs": 2, "stores": 0}

    assert not folders[expired.pk].exists() and not unknown.exists()
    assert all(folders[job.pk].is_dir() for job in (recent, preempted, running))
    gone = api_client_for(alice).get(f"/api/jobs/{expired.pk}/outputs/")
    assert gone.status_code == 404 and "deleted after the retention of 30 days" in gone.json()["detail"]


def test_a_retention_of_zero_keeps_everything(alice, submit, team_a, settings):
    settings.MERIDIAN_BUNDLE_GRACE_DAYS = 0
    settings.MERIDIAN_OUTPUTS_RETENTION_DAYS = 0
    settings.MERIDIAN_ENDED_STORE_GRACE_SECONDS = 0
    bundle = uploaded(alice, days_ago=1000)
    job = ended(submit(team_a, alice), days_ago=1000)
    folder = with_outputs(job.pk)
    store = with_store(job.pk)
    age(store, days=1000)
    assert artifacts_gc() == {"bundles": 0, "outputs": 0, "stores": 0}
    assert bundle_path(bundle.sha256).is_file() and folder.is_dir() and store.is_dir()


def test_the_management_command_lists_with_dry_run_and_deletes_without(alice, submit, team_a):
    bundle = uploaded(alice, days_ago=30)
    job = ended(submit(team_a, alice), days_ago=60)
    folder = with_outputs(job.pk)
    out = io.StringIO()
    call_command("artifacts_gc", "--dry-run", stdout=out)
    assert f"would delete bundle {bundle.sha256}" in out.getvalue()
    assert f"would delete the saved outputs of job {job.pk}" in out.getvalue()
    assert bundle_path(bundle.sha256).is_file() and folder.is_dir()
    out = io.StringIO()
    call_command("artifacts_gc", stdout=out)
    assert "deleted 1 bundle(s), the outputs of 1 job(s) and the checkpoint stores of 0" in out.getvalue()
    assert not bundle_path(bundle.sha256).exists() and not folder.exists()


def with_store(job_id, generation=2):
    folder = pathlib.Path(job_store_uri(job_id, generation=generation)) / "ckpt-12-1700000000000000000"
    folder.mkdir(parents=True)
    (folder / "MANIFEST.json").write_text("{}")
    return folder.parent.parent


def test_a_store_no_agent_removed_goes_after_the_grace_never_a_live_or_recent_or_still_written_one(
        alice, submit, team_a):
    """The short chaos soak in CI left one: a job cancelled while it waited (no agent held a copy
    to kill, so none removed its store)."""
    cancelled = ended(submit(team_a, alice), days_ago=1, state=Job.State.CANCELLED)
    succeeded = ended(submit(team_a, alice), days_ago=1)
    failed_old = ended(submit(team_a, alice), days_ago=31, state=Job.State.FAILED)
    failed_recent = ended(submit(team_a, alice), days_ago=1, state=Job.State.FAILED)  # kept to look into
    just_cancelled = submit(team_a, alice)
    Job.objects.filter(pk=just_cancelled.pk).update(state=Job.State.CANCELLED,
                                                    finished_at=timezone.now() - timedelta(seconds=120))
    written = ended(submit(team_a, alice), days_ago=1, state=Job.State.CANCELLED)  # a fenced copy still writes
    preempted = submit(team_a, alice)
    Job.objects.filter(pk=preempted.pk).update(state=Job.State.PREEMPTED)  # resumes from it
    stores = {job.pk: with_store(job.pk) for job in (cancelled, succeeded, failed_old, failed_recent,
                                                     just_cancelled, written, preempted)}
    for folder in stores.values():
        age(folder, days=90)
    (stores[written.pk] / "g2" / "ckpt-13-1700000000000000001").mkdir()
    unknown = with_store(99999)
    age(unknown, days=31)
    not_a_job = pathlib.Path(django_settings.MERIDIAN_CHECKPOINT_STORE) / "job-abc"
    not_a_job.mkdir()
    age(not_a_job, days=90)

    assert artifacts_gc() == {"bundles": 0, "outputs": 0, "stores": 4}

    assert not any(stores[job.pk].exists() for job in (cancelled, succeeded, failed_old)) and not unknown.exists()
    assert all(stores[job.pk].is_dir() for job in (failed_recent, just_cancelled, written, preempted))
    assert not_a_job.is_dir()


def test_the_store_grace_is_never_shorter_than_twice_the_lost_node_threshold(alice, submit, team_a, settings):
    settings.MERIDIAN_ENDED_STORE_GRACE_SECONDS = 10
    settings.MERIDIAN_NODE_LOST_AFTER_SECONDS = 300  # a cut-off copy writes for up to 5 minutes
    job = submit(team_a, alice)
    Job.objects.filter(pk=job.pk).update(state=Job.State.CANCELLED, finished_at=timezone.now() - timedelta(seconds=400))
    store = with_store(job.pk)
    age(store, days=1)
    assert artifacts_gc()["stores"] == 0 and store.is_dir()
    Job.objects.filter(pk=job.pk).update(finished_at=timezone.now() - timedelta(seconds=700))
    assert artifacts_gc()["stores"] == 1 and not store.exists()


def test_celery_beat_runs_the_collection():
    entry = next(e for e in django_settings.CELERY_BEAT_SCHEDULE.values() if e["task"] == "jobs.tasks.artifacts_gc")
    assert entry["schedule"] > 0
