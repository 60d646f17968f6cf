"""The team quota counter (jobs.models.TeamQuotaClaim): job_submit claims, the state machine
releases, and the counter always equals the sum it replaces (on SQLite and on PostgreSQL: CI's
second pass runs these again)."""
import random

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.test.utils import CaptureQueriesContext

from jobs.models import Job, TeamQuotaClaim
from jobs.services import (
    TRANSITIONS,
    _team_quota_claimed_recomputed,
    job_transition,
    jobs_transition_bulk,
    team_quota_claimed,
    team_quota_recount,
)

pytestmark = pytest.mark.django_db


def _counter(team, accelerator_type="CPU"):
    return TeamQuotaClaim.objects.get(team=team, accelerator_type=accelerator_type).claimed


def test_the_counter_equals_the_recomputed_sum_after_random_transitions(team_a, alice, submit):
    team_a.quotas = {"CPU": 10_000, "H100-80GB": 10_000}
    team_a.save()
    rng = random.Random(18)
    jobs = [submit(team_a, alice, accelerator_type=rng.choice(["CPU", "H100-80GB"]),
                   world_size=8, min_devices=rng.choice([1, 2, 4, 8])) for _ in range(24)]
    for step in range(200):
        live = [job for job in jobs if job.state not in Job.TERMINAL_STATES]
        if not live or rng.random() < 0.15:
            jobs.append(submit(team_a, alice, world_size=4, min_devices=rng.choice([1, 2, 4])))
            continue
        if rng.random() < 0.3:
            # several jobs of one state through the bulk path
            state = rng.choice(sorted({job.state for job in live}))
            group = [job for job in live if job.state == state][: rng.randint(1, 4)]
            to = rng.choice(sorted(TRANSITIONS[state]))
            jobs_transition_bulk(jobs=group, to=to, reasons={job.pk: f"step {step}" for job in group})
        else:
            job = rng.choice(live)
            job_transition(job=job, to=rng.choice(sorted(TRANSITIONS[job.state])), reason=f"step {step}")
        for accelerator_type in ("CPU", "H100-80GB"):
            assert _counter(team_a, accelerator_type) == _team_quota_claimed_recomputed(
                team_id=team_a.pk, accelerator_type=accelerator_type), f"step {step}, {accelerator_type}"
    assert any(job.state in Job.TERMINAL_STATES for job in jobs)  # the walk did release claims


def test_the_bulk_path_releases_jobs_loaded_with_deferred_fields(team_a, alice, submit):
    team_a.quotas = {"CPU": 100}
    team_a.save()
    jobs = [submit(team_a, alice, world_size=4, min_devices=4) for _ in range(3)]
    assert _counter(team_a) == 12
    # the tick loads its jobs with .only(): min_devices and team are then deferred
    loaded = list(Job.objects.filter(pk__in=[job.pk for job in jobs]).only("id", "state"))
    jobs_transition_bulk(jobs=loaded, to=Job.State.CANCELLED)
    assert _counter(team_a) == 0


def test_a_submission_over_quota_is_refused_and_claims_nothing(team_a, alice, submit):
    team_a.quotas = {"CPU": 6}
    team_a.save()
    submit(team_a, alice, world_size=4, min_devices=4)
    with pytest.raises(ValidationError, match="already claim 4 and this job needs 4 more"):
        submit(team_a, alice, world_size=4, min_devices=4)
    assert _counter(team_a) == 4
    assert Job.objects.filter(team=team_a).count() == 1
    submit(team_a, alice, world_size=2, min_devices=2)  # exactly at the quota
    assert team_quota_claimed(team=team_a, accelerator_type="CPU") == 6


def test_a_finished_job_gives_its_claim_back(team_a, alice, submit):
    team_a.quotas = {"CPU": 4}
    team_a.save()
    job = submit(team_a, alice, world_size=4, min_devices=4)
    with pytest.raises(ValidationError):
        submit(team_a, alice, world_size=4, min_devices=4)
    job_transition(job=job, to=Job.State.CANCELLED)
    submit(team_a, alice, world_size=4, min_devices=4)
    assert _counter(team_a) == 4


def test_the_quota_check_does_not_scan_the_queue(team_a, alice, submit):
    """The old check summed min_devices over every unfinished job of the team per submission."""
    team_a.quotas = {"CPU": 10_000}
    team_a.save()
    submit(team_a, alice, world_size=1, min_devices=1)

    def queries_of_one_submission():
        with CaptureQueriesContext(connection) as captured:
            submit(team_a, alice, world_size=1, min_devices=1)
        return [query["sql"] for query in captured.captured_queries]

    few = queries_of_one_submission()
    for _ in range(30):
        submit(team_a, alice, world_size=1, min_devices=1)
    many = queries_of_one_submission()
    assert len(few) == len(many)
    assert not [sql for sql in many if "SUM(" in sql.upper()], many
    assert not [sql for sql in many if "FOR UPDATE" in sql.upper()], many


def test_the_first_claim_of_a_type_counts_jobs_written_before_the_counter(team_a, alice, submit):
    team_a.quotas = {"CPU": 10}
    team_a.save()
    submit(team_a, alice, world_size=4, min_devices=4)
    TeamQuotaClaim.objects.all().delete()  # a database from before the counter existed
    assert team_quota_claimed(team=team_a, accelerator_type="CPU") == 4
    submit(team_a, alice, world_size=4, min_devices=4)
    assert _counter(team_a) == 8
    with pytest.raises(ValidationError, match="already claim 8"):
        submit(team_a, alice, world_size=4, min_devices=4)


def test_recount_repairs_a_counter_that_drifted(team_a, alice, submit):
    team_a.quotas = {"CPU": 10}
    team_a.save()
    submit(team_a, alice, world_size=4, min_devices=2)
    TeamQuotaClaim.objects.filter(team=team_a).update(claimed=9)
    assert team_quota_recount() == 1
    assert _counter(team_a) == 2
    assert team_quota_recount() == 0
