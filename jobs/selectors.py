"""Selectors: reads of jobs, teams and preemption requests (services write).

List selectors return QuerySets with the joins their callers need already chosen,
so an API page of N jobs costs a constant number of queries.
"""
from django.db.models import Count, Sum
from django.http import Http404

from jobs.models import Job, JobEvent, Membership, PreemptionRequest, Team

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
        jobs = jobs.filter(team__id=int(team)) if str(team).isdigit() else jobs.filter(team__slug=team)
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
