"""`meridian submit --array N` (Slurm's --array) against a real control plane: one bulk request,
N jobs or none."""
import json

import pytest

from cli.client import Client
from jobs.models import Job, Team
from tests.cli.test_cli import isolated, logged_in, project, run  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)


def test_array_submits_n_copies_each_with_its_task_id(logged_in, project, monkeypatch, capsys):  # noqa: F811
    monkeypatch.chdir(project)
    code, out, err = run(capsys, "submit", "--json", "--array", "5", "--tier", "basic", "--", "python", "train.py")
    assert code == 0, err
    ids = json.loads(out)["ids"]
    assert len(ids) == 5
    client = Client.from_config()
    jobs = [client.get(f"/api/jobs/{job_id}/") for job_id in ids]
    assert [job["name"] for job in jobs] == [f"proj[{i}]" for i in range(5)]
    assert [job["env"]["MERIDIAN_ARRAY_TASK_ID"] for job in jobs] == [str(i) for i in range(5)]
    assert {job["state"] for job in jobs} == {"pending"}


def test_every_copy_of_an_array_gets_the_resume_policy(logged_in, project, monkeypatch, capsys):  # noqa: F811
    monkeypatch.chdir(project)
    code, out, err = run(capsys, "submit", "--json", "--array", "2", "--if-resume-refused", "restart", "--", "python",
                         "train.py")
    assert code == 0, err
    assert set(Job.objects.filter(pk__in=json.loads(out)["ids"]).values_list("if_resume_refused", flat=True)) == {
        "restart"}


def test_an_array_over_the_quota_submits_nothing_and_says_why(logged_in, project, monkeypatch, capsys):  # noqa: F811
    monkeypatch.chdir(project)
    Team.objects.filter(slug="team-a").update(quotas={"CPU": 3})
    before = Job.objects.count()
    code, _, err = run(capsys, "submit", "--team", "team-a", "--array", "5", "--", "python", "train.py")
    assert code == 1 and "over team quota" in err and "these 5 jobs need 5 more" in err
    code, _, err = run(capsys, "submit", "--array", "0", "--", "python", "train.py")
    assert code == 1 and "--array wants a number of copies" in err
    assert Job.objects.count() == before
