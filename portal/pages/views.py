"""The dashboard pages: fleet (with a node's drain / undrain), jobs, submit, approvals, teams.

Server-rendered; each page's small script (static/pages/*.js) joins its live groups
over the WebSocket (portal.pages.consumers) and, on a push, fetches the page's own
JSON or HTML fragment again (the same view with ?format=json or ?fragment=rows), so a
live update and a reload show exactly the same thing and the same permission checks.

Roles and isolation: every view needs a login; another team's job is a 404 (as in the
API), the approvals page is a 403 for anyone who is not a capacity manager or admin
of some team.
"""
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404, HttpResponseBadRequest, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from fleet.accelerator_types import ACCELERATOR_TYPE_CHOICES
from fleet.models import Node
from fleet.selectors import node_list
from fleet.services import NodeStateConflict, node_drain, node_operator_check, node_undrain, user_is_fleet_operator
from jobs.models import Job, JobEvent, Membership, Tier
from jobs.selectors import (
    approver_team_ids,
    job_event_list,
    job_get_visible_or_404,
    job_list_visible,
    job_names_redact_objects,
    job_placement_now,
    preemption_get_visible,
    team_list_for_user,
    team_usage,
)
from jobs.services import IllegalTransition, job_cancel, job_submit, preemption_approve, preemption_deny
from portal.pages.forms import JobSubmitForm, NodeDrainForm, PreemptionDecisionForm
from portal.pages.logs import job_log_context
from portal.pages.selectors import (
    fleet_page_data,
    job_place_in_line,
    job_timeline,
    preemption_audit_trail,
    preemption_pending_for,
)

JOB_LIST_LIMIT = 200
# Agents report progress every few seconds: those events feed the progress fields, not the
# timeline, and the events table shows the newest of the rest.
JOB_EVENTS_SHOWN = 200


MAX_ID = 2**63 - 1


class BadParameter(ValueError):
    """A query parameter a person can fix; the page answers 400 with this message."""


def _int_param(request, name):
    value = request.GET.get(name)
    if value in (None, ""):
        return None
    # isascii: "²".isdigit() is true, but int() refuses it
    if not (value.isascii() and value.isdigit()) or int(value) > MAX_ID:
        raise BadParameter(f"{name} must be a whole number between 1 and {MAX_ID}, got {value[:40]!r}")
    return int(value)


def _nav_context(request):
    return {"can_approve": bool(approver_team_ids(user=request.user))}


# --- fleet -----------------------------------------------------------------------------


@login_required
def fleet_page(request):
    """The fleet heatmap; ?cluster=<id> or ?node=<id> drills down, ?format=json is its live data."""
    try:
        cluster_id, node_id = _int_param(request, "cluster"), _int_param(request, "node")
    except BadParameter as error:
        return HttpResponseBadRequest(str(error), content_type="text/plain; charset=utf-8")
    data = fleet_page_data(user=request.user, cluster_id=cluster_id, node_id=node_id)
    if data is None:
        raise Http404("no such cluster or node")
    if request.GET.get("format") == "json":
        return JsonResponse(data)
    context = {**_nav_context(request), "data": data, "page": "fleet"}
    if node_id is not None:
        # the node's state and drain, and the drain / undrain form for those who may
        context.update(node=node_list().get(pk=node_id), can_drain=user_is_fleet_operator(request.user),
                       drain_form=NodeDrainForm())
    return render(request, "pages/fleet.html", context)


def _node_page_or_404(node_id):
    node = Node.objects.filter(pk=node_id).first()
    if node is None:
        raise Http404(f"no node {node_id}")
    return node


@login_required
@require_POST
def node_drain_page(request, node_id):
    """Drains the node (fleet.services.node_drain: global admins only, else a 403) and goes back to
    its page; a missing reason or a lost node is said there."""
    node = _node_page_or_404(node_id)
    form = NodeDrainForm(request.POST)
    node_operator_check(request.user, "drain")  # PermissionDenied (a 403) before any word on the form
    if not form.is_valid():
        messages.error(request, f"Node {node.hostname} not drained: say why, in at most "
                                f"{form.fields['reason'].max_length} characters.")
    else:
        try:
            node_drain(node=node, by=request.user, reason=form.cleaned_data["reason"])
        except NodeStateConflict as error:
            messages.error(request, str(error))
        else:
            messages.success(request, f"Node {node.hostname} is draining: the next tick moves its jobs off.")
    return redirect(f"{reverse('pages:fleet')}?node={node.pk}")


@login_required
@require_POST
def node_undrain_page(request, node_id):
    node = _node_page_or_404(node_id)
    try:
        node_undrain(node=node, by=request.user)  # PermissionDenied (a 403) unless a global admin
    except NodeStateConflict as error:
        messages.error(request, str(error))
    else:
        messages.success(request, f"Node {node.hostname} is {node.state}: jobs may be placed on it.")
    return redirect(f"{reverse('pages:fleet')}?node={node.pk}")


# --- jobs -------------------------------------------------------------------------------


def _job_filters(request, teams):
    filters, chosen = {}, {}
    choices = {
        "state": dict(Job.State.choices),
        "tier": dict(Tier.choices),
        "accelerator_type": dict(ACCELERATOR_TYPE_CHOICES),
        "team": {str(t.pk): t.name for t in teams},
    }
    for field, allowed in choices.items():
        value = request.GET.get(field, "")
        if value and value in allowed:
            filters[field] = value
            chosen[field] = value
    return filters, chosen, choices


@login_required
def job_list_page(request):
    """Your teams' jobs, newest first, filtered by state, tier, team, accelerator type;
    ?fragment=rows returns just the table rows (the live refresh)."""
    teams = list(team_list_for_user(user=request.user).order_by("name"))
    filters, chosen, choices = _job_filters(request, teams)
    jobs = list(job_list_visible(user=request.user, filters=filters)[:JOB_LIST_LIMIT])
    job_names_redact_objects(user=request.user, objects=jobs)
    context = {"jobs": jobs, "limit": JOB_LIST_LIMIT}
    if request.GET.get("fragment") == "rows":
        return render(request, "pages/_job_rows.html", context)
    return render(
        request,
        "pages/job_list.html",
        {
            **_nav_context(request),
            **context,
            "page": "jobs",
            "teams": teams,
            "chosen": chosen,
            "choices": {k: sorted(v.items(), key=lambda kv: kv[1]) for k, v in choices.items()},
            "team_ids": [t.pk for t in teams],
        },
    )


def _job_detail_data(job, *, user):
    events = list(job_event_list(job=job).exclude(type=JobEvent.Type.PROGRESS))
    # other teams' job names out of the scheduler's reasons (rendering only; never saved)
    job_names_redact_objects(user=user, objects=[job, *events])
    position, position_source = job_place_in_line(job=job)
    return events, {
        "job": {
            "id": job.pk,
            "state": job.state,
            "state_display": job.get_state_display(),
            "device_count": job.device_count,
            "progress_step": job.progress_step,
            "total_steps": job.total_steps,
            "steps_per_second": job.steps_per_second,
            "last_checkpoint_step": job.last_checkpoint_step,
            "wait_reason": job.wait_reason,
            "queue_position": position,
            "queue_position_source": position_source,
            "attained_sla_fraction": job.attained_sla_fraction,
            "is_terminal": job.is_terminal,
            "placement": job_placement_now(job=job),
        },
        "timeline": job_timeline(job=job, events=events),
    }


@login_required
def job_detail_page(request, job_id):
    """A job: its state, progress, place in line, Gantt timeline and events; cancel.
    ?format=json returns the live data (state, progress, timeline, events HTML)."""
    job = job_get_visible_or_404(user=request.user, job_id=job_id)
    events, data = _job_detail_data(job, user=request.user)
    if request.GET.get("format") == "json":
        data["events_html"] = render(
            request, "pages/_job_events.html", {"events": events[-JOB_EVENTS_SHOWN:]}
        ).content.decode()
        data["summary_html"] = render(
            request, "pages/_job_summary.html", {"job": job, "data": data["job"]}
        ).content.decode()
        return JsonResponse(data)
    return render(
        request,
        "pages/job_detail.html",
        {**_nav_context(request), "page": "jobs", "job": job, "events": events[-JOB_EVENTS_SHOWN:], "data": data,
         **job_log_context(job)},
    )


@login_required
@require_POST
def job_cancel_page(request, job_id):
    job = job_get_visible_or_404(user=request.user, job_id=job_id)
    try:
        job_cancel(job=job, by=request.user, reason=request.POST.get("reason", "").strip())
    except IllegalTransition as error:
        messages.error(request, str(error))
    else:
        messages.success(request, f"Job #{job.pk} cancelled.")
    return redirect("pages:job-detail", job_id=job.pk)


@login_required
def job_submit_page(request):
    """A form for a job; job_submit validates it and its errors appear at their fields."""
    teams = list(team_list_for_user(user=request.user).order_by("name"))
    if not teams:
        raise PermissionDenied("you are on no team; ask a team admin to add you before submitting jobs")
    form = JobSubmitForm(request.POST or None, request.FILES or None, teams=teams)
    if request.method == "POST" and form.is_valid():
        bundle = form.bundle_upload(user=request.user)
        try:
            if form.errors:
                raise ValidationError({})
            job = job_submit(team=form.team_chosen(), submitted_by=request.user,
                             spec={**form.spec(), "bundle": bundle} if bundle else form.spec())
        except ValidationError as error:
            form.add_service_errors(error)
        else:
            messages.success(request, f"Job #{job.pk} {job.name} submitted.")
            return redirect("pages:job-detail", job_id=job.pk)
    return render(request, "pages/job_submit.html", {**_nav_context(request), "page": "submit", "form": form})


# --- approvals ----------------------------------------------------------------------------


def _approver_teams_or_403(request):
    team_ids = approver_team_ids(user=request.user)
    if not team_ids:
        raise PermissionDenied("only capacity managers see preemption approvals")
    return team_ids


def _blast_radius(request_row):
    job = request_row.job
    steps_lost = None
    if job.last_checkpoint_step is not None:
        steps_lost = max(job.progress_step - job.last_checkpoint_step, 0)
    elif job.progress_step:
        steps_lost = job.progress_step
    return {
        "request": request_row,
        "job": job,
        "steps_lost": steps_lost,
        "sla": job.attained_sla_fraction,
        "sla_target": job.sla_target,
        "below_target": job.attained_sla_fraction is not None and job.attained_sla_fraction < job.sla_target,
        "expires_in": max((request_row.expires_at - timezone.now()).total_seconds(), 0),
    }


@login_required
def approvals_page(request):
    """Pending preemption requests on the teams you manage, with their blast radius, and
    the audit trail of decisions. ?fragment=rows returns both tables (live refresh)."""
    team_ids = _approver_teams_or_403(request)
    context = {
        "pending": [_blast_radius(r) for r in preemption_pending_for(team_ids=team_ids)],
        "trail": list(preemption_audit_trail(team_ids=team_ids)),
        "decision_form": PreemptionDecisionForm(),
    }
    if request.GET.get("fragment") == "rows":
        return render(request, "pages/_approvals_tables.html", context)
    return render(
        request,
        "pages/approvals.html",
        {**_nav_context(request), **context, "page": "approvals", "team_ids": sorted(team_ids)},
    )


@login_required
@require_POST
def approval_decide_page(request, request_id):
    team_ids = _approver_teams_or_403(request)
    preemption = preemption_get_visible(user=request.user, request_id=request_id)
    if preemption is None or preemption.job.team_id not in team_ids:
        raise Http404(f"no preemption request {request_id} on the teams you manage")
    form = PreemptionDecisionForm(request.POST)
    if not form.is_valid():
        return HttpResponseBadRequest("choose approve or deny; the note is at most 2000 characters")
    decide = preemption_approve if form.cleaned_data["decision"] == "approve" else preemption_deny
    try:
        decide(request=preemption, by=request.user, note=form.cleaned_data["note"])
    except IllegalTransition as error:
        messages.error(request, str(error))
    else:
        verb = "approved" if decide is preemption_approve else "denied"
        messages.success(request, f"Preemption of job #{preemption.job_id} {verb}.")
    return redirect(reverse("pages:approvals"))


# --- teams ------------------------------------------------------------------------------------


@login_required
def team_list_page(request):
    """Your teams: quota, claimed and in-use devices per accelerator type, and your role."""
    roles = dict(Membership.objects.filter(user_id=request.user.pk).values_list("team_id", "role"))
    role_names = dict(Membership.Role.choices)
    teams = []
    for team in team_list_for_user(user=request.user).order_by("name"):
        usage = sorted(team_usage(team=team).items())
        teams.append(
            {
                "team": team,
                "role": role_names.get(roles.get(team.pk), "global admin" if request.user.is_superuser else ""),
                "usage": [
                    {
                        "type": type_name,
                        **row,
                        "claimed_fraction": (row["claimed"] / row["quota"]) if row["quota"] else None,
                    }
                    for type_name, row in usage
                ],
            }
        )
    return render(request, "pages/teams.html", {**_nav_context(request), "page": "teams", "teams": teams})
