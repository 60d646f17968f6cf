"""Selectors: reads of jobs, teams and preemption requests (services write).

List selectors return QuerySets with the joins their callers need already chosen,
so an API page of N jobs costs a constant number of queries.
"""
import json
import re
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models import Avg, Count, Max, Min, Sum
from django.http import Http404

from fleet.models import Accelerator
from jobs.bulk import cursor_prepared
from jobs.models import Job, JobEvent, Membership, PreemptionRequest, Replica, Team

# How the scheduler names a job in its reasons (jobs.snapshot: "#<id> <name>").
JOB_REFERENCE = re.compile(r"#(\d{1,19}) ")
REDACTED_JOB_NAME = "(another team's job)"

# Who decides a team's preemption requests: its capacity managers and admins (and global admins).
APPROVER_ROLES = (Membership.Role.CAPACITY_MANAGER, Membership.Role.ADMIN)


def team_ids_for_user(user):
    """Returns the ids of the teams `user` belongs to (every team for a global admin)."""
    if not (user and user.is_authenticated):
        return []
    if user.is_superuser:
        return list(Team.objects.values_list("id", flat=True))
    return list(Membership.objects.filter(user_id=user.pk).values_list("team_id", flat=True))


def approver_team_ids(*, user) -> set[int]:
    """Returns the ids of the teams whose preemption requests `user` may decide: every team for a
    global admin, those where the user is a capacity manager or admin otherwise, none when anonymous."""
    if not (user and user.is_authenticated):
        return set()
    if user.is_superuser:
        return set(team_ids_for_user(user))
    return set(
        Membership.objects.filter(user_id=user.pk, role__in=APPROVER_ROLES).values_list("team_id", flat=True)
    )


@dataclass(frozen=True)
class TokenSubmitter:
    """The user an API token belongs to and the teams they are a member of (unsaved rows built
    from one query: Team with id, slug, name, quotas; the user with id, username, is_superuser)."""

    user: object
    teams: tuple[Team, ...]


_SUBMITTER_SQL: dict[str, str] = {}


def submitter_by_token(*, key: str) -> TokenSubmitter | None:
    """Returns the active user whose API token (rest_framework.authtoken) is `key`, with their
    teams by name, in ONE query; None when the key is unknown, its user inactive, or the user on
    no team (the callers send those to DRF's TokenAuthentication and the submit API, which say
    why). For the fast path of POST /api/jobs/ (jobs/submit_api.py): DRF's authentication, the
    team list and the membership check cost three ORM queries (~3 ms of Python)."""
    from rest_framework.authtoken.models import Token

    sql = _SUBMITTER_SQL.get(connection.vendor)
    if sql is None:
        qn = connection.ops.quote_name
        user_model = get_user_model()
        token, user, member, team = (qn(m._meta.db_table) for m in (Token, user_model, Membership, Team))
        sql = _SUBMITTER_SQL[connection.vendor] = (
            f"SELECT u.{qn('id')}, u.{qn('username')}, u.{qn('is_superuser')}, t.{qn('id')}, t.{qn('slug')}, "
            f"t.{qn('name')}, t.{qn('quotas')} FROM {token} k JOIN {user} u ON u.{qn('id')} = k.{qn('user_id')} "
            f"JOIN {member} m ON m.{qn('user_id')} = u.{qn('id')} JOIN {team} t ON t.{qn('id')} = m.{qn('team_id')} "
            f"WHERE k.{qn('key')} = %s AND u.{qn('is_active')} ORDER BY t.{qn('name')}")
    with cursor_prepared() as cursor:
        cursor.execute(sql, [key])
        rows = cursor.fetchall()
    if not rows:
        return None
    user_id, username, is_superuser = rows[0][:3]
    user = get_user_model()(id=user_id, username=username, is_superuser=bool(is_superuser), is_active=True)
    teams = tuple(Team(id=team_id, slug=slug, name=name,
                       quotas=json.loads(quotas) if isinstance(quotas, str) else quotas)
                  for *_, team_id, slug, name, quotas in rows)
    return TokenSubmitter(user=user, teams=teams)


def team_list_for_user(*, user):
    if user.is_superuser:
        return Team.objects.all()
    return Team.objects.filter(memberships__user_id=user.pk).distinct()


def job_list_visible(*, user, filters=None):
    """Returns the jobs of the user's teams, newest first, filtered by any of
    state, tier, team (id or slug), accelerator_type (each a value or a list)."""
    jobs = Job.objects.select_related("team", "submitted_by", "region")
    if not user.is_superuser:
        jobs = jobs.filter(team__memberships__user_id=user.pk)
    for field in ("state", "tier", "accelerator_type"):
        value = (filters or {}).get(field)
        if value:
            jobs = jobs.filter(**{f"{field}__in": value if isinstance(value, (list, tuple)) else [value]})
    team = (filters or {}).get("team")
    if team:
        team = str(team)
        # isascii: "²".isdigit() is true but int() refuses it; 18 digits fit the id column
        numeric = team.isascii() and team.isdigit() and len(team) <= 18
        jobs = jobs.filter(team__id=int(team)) if numeric else jobs.filter(team__slug=team)
    return jobs.order_by("-submitted_at", "-id")


def job_get_visible(*, user, job_id):
    """Returns the job if the user may see it, else None (callers answer 404, not 403)."""
    return job_list_visible(user=user).filter(pk=job_id).first()


def job_get_visible_or_404(*, user, job_id) -> Job:
    """Returns the job if the user may see it; raises Http404 naming it otherwise (an API view's
    handler turns that into the same 404 body, so pages and the API answer alike)."""
    job = job_get_visible(user=user, job_id=job_id)
    if job is None:
        raise Http404(f"no job {job_id} among your teams' jobs")
    return job


def job_event_list(*, job):
    return JobEvent.objects.filter(job=job).select_related("actor").order_by("created_at", "id")


def job_list_pending():
    """Returns the jobs waiting for devices (pending or preempted), oldest first."""
    return (
        Job.objects.filter(state__in=Job.WAITING_STATES)
        .select_related("team")
        .order_by("submitted_at", "id")
    )


def job_list_active():
    """Returns the unfinished jobs (waiting ones included) with their team."""
    return Job.objects.exclude(state__in=Job.TERMINAL_STATES).select_related("team")


def preemption_list_visible(*, user, state=None):
    """Returns preemption requests on the user's teams' jobs, newest first."""
    requests = PreemptionRequest.objects.select_related("job", "job__team", "decided_by")
    if not user.is_superuser:
        requests = requests.filter(job__team__memberships__user_id=user.pk)
    if state:
        requests = requests.filter(state=state)
    return requests.order_by("-requested_at", "-id")


def preemption_get_visible(*, user, request_id):
    return preemption_list_visible(user=user).filter(pk=request_id).first()


def preemption_list_approved():
    """Returns approved requests whose jobs still hold devices: the control loop's to-do."""
    return PreemptionRequest.objects.filter(
        state=PreemptionRequest.State.APPROVED, job__state=Job.State.RUNNING
    ).select_related("job")


def team_usage_many(*, teams):
    """Returns {team_id: team_usage(team)} for several teams in one query."""
    rows = (
        Job.objects.filter(team__in=teams)
        .exclude(state__in=Job.TERMINAL_STATES)
        .values("team_id", "accelerator_type")
        .annotate(claimed=Sum("min_devices"), in_use=Sum("device_count"), jobs=Count("id"))
    )
    usage = {
        team.pk: {t: {"quota": int(q), "claimed": 0, "devices_in_use": 0, "jobs": 0} for t, q in team.quotas.items()}
        for team in teams
    }
    quotas = {team.pk: team for team in teams}
    for row in rows:
        entry = usage[row["team_id"]].setdefault(
            row["accelerator_type"],
            {
                "quota": quotas[row["team_id"]].quota_for(row["accelerator_type"]),
                "claimed": 0, "devices_in_use": 0, "jobs": 0,
            },
        )
        entry.update(claimed=row["claimed"] or 0, devices_in_use=row["in_use"] or 0, jobs=row["jobs"])
    return usage


def team_usage(*, team):
    """Returns {accelerator_type: {"quota", "claimed", "devices_in_use", "jobs"}} for the team.

    claimed = sum of min_devices over unfinished jobs (what quota limits);
    devices_in_use = devices under its jobs now.
    """
    return team_usage_many(teams=[team])[team.pk]


def job_state_counts(*, user=None):
    """Returns {state: count} over the jobs the user sees (all jobs when user is None)."""
    jobs = Job.objects.all() if user is None else job_list_visible(user=user)
    return dict(jobs.order_by().values_list("state").annotate(n=Count("id")))


def viewer_sees_every_job_name(*, user) -> bool:
    """True for global admins and capacity managers or admins of some team: they weigh one team's
    job against another's (approvals), so reasons show them every job's name."""
    return bool(user and user.is_authenticated and (user.is_superuser or approver_team_ids(user=user)))


def job_names_redacted(*, user, texts) -> list[str]:
    """Returns `texts` (reasons of the scheduler, a preemption request's reason, an event's reason)
    with the name of every job `user` may not see replaced by REDACTED_JOB_NAME: "#135 <name>"
    becomes "#135 (another team's job)". Members see their own teams' job names; capacity managers
    and global admins see all (viewer_sees_every_job_name). At most two queries, whatever the
    number of texts. None and "" pass through unchanged."""
    texts = list(texts)
    ids = {int(ref) for text in texts if text for ref in JOB_REFERENCE.findall(text)}
    if not ids or viewer_sees_every_job_name(user=user):
        return texts
    hidden = (Job.objects.filter(pk__in=ids).exclude(team_id__in=team_ids_for_user(user))
              .values_list("id", "name"))
    replacements = [(f"#{pk} {name}", f"#{pk} {REDACTED_JOB_NAME}") for pk, name in hidden if name]
    if not replacements:
        return texts
    # Longest first: a name that is a prefix of another job's reference is replaced last.
    replacements.sort(key=lambda pair: -len(pair[0]))
    redacted = []
    for text in texts:
        if text:
            for shown, hidden_as in replacements:
                text = text.replace(shown, hidden_as)
        redacted.append(text)
    return redacted


def job_names_redact_objects(*, user, objects, fields=("wait_reason", "reason")) -> None:
    """Applies job_names_redacted to the `fields` of `objects` (model instances or dicts), in place:
    for rendering only (the rows are never saved from here). Missing fields are skipped."""
    objects = list(objects)
    slots = []
    for obj in objects:
        for field in fields:
            value = obj.get(field) if isinstance(obj, dict) else getattr(obj, field, None)
            if isinstance(value, str) and value:
                slots.append((obj, field, value))
    for (obj, field, _), text in zip(slots, job_names_redacted(user=user, texts=[v for _, _, v in slots])):
        if isinstance(obj, dict):
            obj[field] = text
        else:
            setattr(obj, field, text)


def job_placement_now(*, job) -> list[dict]:
    """Returns where the job runs now and what its devices report, one row per host in rank order:
    {"host", "first_rank", "last_rank", "devices", "utilization", "memory_used_gb", "reporting",
    "read_at"} (a job spanning hosts runs one contiguous block of ranks on each; a job holding no
    devices: []). `utilization` is the mean of the latest readings of the job's devices there
    (0..1, None when none reports one), `memory_used_gb` their sum (None when none reports memory,
    as CPU slots do not), `reporting` how many of them have a reading, `read_at` the host's last
    telemetry. A GPU is held by one job at a time, so its NVML readings are the job's own; a CPU
    slot's utilization is its node's busy fraction (agent/devices.py). Two grouped queries."""
    ranks = (Replica.objects.filter(job=job, device__isnull=False)
             .values_list("device__node__hostname")
             .annotate(first=Min("rank"), last=Max("rank"), devices=Count("device_id", distinct=True)))
    readings = {
        row["node__hostname"]: row for row in
        Accelerator.objects.filter(pk__in=Replica.objects.filter(job=job).values("device_id"))
        .values("node__hostname", "node__telemetry_at")
        .annotate(mean=Avg("utilization"), memory=Sum("memory_used_gb"), reporting=Count("utilization"))}
    rows = []
    for host, first, last, devices in sorted(ranks, key=lambda row: row[1]):
        read = readings.get(host) or {}
        utilization, memory = read.get("mean"), read.get("memory")
        rows.append({"host": host, "first_rank": first, "last_rank": last, "devices": devices,
                     "utilization": round(utilization, 4) if utilization is not None else None,
                     "memory_used_gb": round(memory, 3) if memory is not None else None,
                     "reporting": read.get("reporting", 0), "read_at": read.get("node__telemetry_at")})
    return rows
