"""REST API for jobs, teams and preemption approvals: one class per action, nested
InputSerializer / OutputSerializer, no business logic (that is in jobs/services.py).

A job or request of a team the user is not on is a 404, never a 403: its existence
is not the user's business. Approving without the capacity-manager role is a 403.
"""
import copy

from drf_spectacular.utils import extend_schema, extend_schema_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from fleet.accelerator_types import ACCELERATOR_TYPE_CHOICES, ACCELERATOR_TYPES
from fleet.pagination import MeridianPagination, paginate
from jobs.models import Job, JobEvent, Membership, PreemptionRequest, Team, Tier
from jobs.selectors import (
    approver_team_ids,
    job_event_list,
    job_get_visible,
    job_get_visible_or_404,
    job_list_visible,
    job_names_redact_objects,
    job_placement_now,
    preemption_get_visible,
    preemption_list_visible,
    team_list_for_user,
    team_usage_many,
)
from jobs.services import (
    MAX_TOTAL_STEPS,
    MAX_WORLD_SIZE,
    JobSpecsInvalid,
    job_cancel,
    job_submit,
    jobs_submit_bulk,
    preemption_approve,
    preemption_deny,
)

TIER_MESSAGE = 'unknown tier "{input}"; choose one of ' + ", ".join(Tier.values)
TYPE_MESSAGE = 'unknown accelerator type "{input}"; known types: ' + ", ".join(ACCELERATOR_TYPES)
STATE_MESSAGE = 'unknown state "{input}"; known states: ' + ", ".join(Job.State.values)
NETWORK_MESSAGE = 'network must be one of ' + ", ".join(Job.Network.values) + ', got "{input}"'
RESUME_REFUSED_MESSAGE = ('if_resume_refused must be one of ' + ", ".join(Job.ResumeRefused.values)
                          + ' (what to do when a resume is refused), got "{input}"')


def _redacted(request, response):
    """Returns `response` with other teams' job names taken out of its reasons (a member sees
    "#135 (another team's job)"; jobs.selectors.job_names_redacted), for a list page or one object."""
    data = response.data
    rows = data.get("results", [data]) if isinstance(data, dict) else data
    job_names_redact_objects(user=request.user, objects=rows)
    return response


class TeamRefSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    slug = serializers.CharField()
    name = serializers.CharField()


@extend_schema_serializer(component_name="Job")
class JobOutputSerializer(serializers.ModelSerializer):
    team = TeamRefSerializer()
    submitted_by = serializers.CharField(source="submitted_by.username", default=None, allow_null=True)
    region = serializers.CharField(source="region.name", default=None, allow_null=True)
    is_elastic = serializers.BooleanField()
    sla_target = serializers.FloatField()
    attained_sla_fraction = serializers.FloatField(allow_null=True)
    bundle = serializers.CharField(source="bundle.sha256", default=None, allow_null=True,
                                   help_text="the code bundle's sha256; null: the entrypoint is on the node")

    class Meta:
        model = Job
        fields = [
            "id", "name", "team", "submitted_by", "tier", "accelerator_type", "world_size", "min_devices",
            "is_elastic", "entrypoint", "args", "env", "total_steps", "state", "state_changed_at",
            "submitted_at", "started_at", "last_started_at", "finished_at", "region", "device_count",
            "attained_device_seconds", "ideal_device_seconds", "attained_sla_fraction", "sla_target",
            "progress_step", "steps_per_second", "last_checkpoint_step", "last_checkpoint_at",
            "checkpoint_bytes", "preemption_count", "migration_count", "resize_count", "wait_reason",
            "queue_position", "exit_code", "failure_reason", "bundle", "if_resume_refused", "network",
        ]

    def get_fields(self):
        # ModelSerializer builds its fields from the model's meta on every instance (~1 ms, a tenth
        # of a submission's CPU); built once per class, each instance gets fresh copies.
        prototype = type(self).__dict__.get("_fields_prototype")
        if prototype is None:
            prototype = super().get_fields()
            type(self)._fields_prototype = prototype
        return copy.deepcopy(prototype)


class StrictInputSerializer(serializers.Serializer):
    """An input serializer that refuses fields it does not know (a typo is a 400, not ignored)."""

    def validate(self, attrs):
        unknown = sorted(set(getattr(self, "initial_data", {}) or {}) - set(self.fields))
        if unknown:
            raise serializers.ValidationError({"non_field_errors": [
                f"unknown field(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(self.fields))}"
            ]})
        return attrs


class JobSubmitApi(APIView):
    @extend_schema_serializer(component_name="JobSubmitInput")
    class InputSerializer(StrictInputSerializer):
        team = serializers.CharField(
            required=False, help_text="Team slug or id; may be left out by a user on exactly one team."
        )
        name = serializers.CharField(max_length=200)
        tier = serializers.ChoiceField(
            choices=Tier.choices, default=Tier.STANDARD, error_messages={"invalid_choice": TIER_MESSAGE}
        )
        accelerator_type = serializers.ChoiceField(
            choices=ACCELERATOR_TYPE_CHOICES, error_messages={"invalid_choice": TYPE_MESSAGE}
        )
        world_size = serializers.IntegerField(
            min_value=1, max_value=MAX_WORLD_SIZE,
            help_text="W, logical ranks; at most MERIDIAN_MAX_WORLD_SIZE, min_devices * MERIDIAN_MAX_RANKS_PER_DEVICE "
                      "and what the fleet could ever hold (a 400 says which).",
            error_messages={"min_value": "world_size (W, logical ranks) must be at least 1",
                            "max_value": f"world_size must be at most {MAX_WORLD_SIZE}"},
        )
        min_devices = serializers.IntegerField(
            min_value=1, default=1, help_text="Fewest devices the job may run on; must divide world_size.",
            error_messages={"min_value": "min_devices must be at least 1"},
        )
        entrypoint = serializers.CharField(max_length=1000)
        args = serializers.ListField(child=serializers.CharField(allow_blank=True), default=list, max_length=1000)
        env = serializers.DictField(child=serializers.CharField(allow_blank=True), default=dict)
        total_steps = serializers.IntegerField(
            min_value=1, max_value=MAX_TOTAL_STEPS, required=False, allow_null=True,
            error_messages={"max_value": f"total_steps must be at most {MAX_TOTAL_STEPS} (2**63 - 1)"},
        )
        bundle = serializers.CharField(
            required=False, allow_null=True, max_length=64,
            help_text="sha256 of a code bundle you uploaded (PUT /api/bundles/<sha256>/); the entrypoint is then "
                      "a path inside it. Left out: the entrypoint is on the node itself.")
        if_resume_refused = serializers.ChoiceField(
            choices=Job.ResumeRefused.choices, default=Job.ResumeRefused.FAIL,
            help_text="When the framework checkpoint engine refuses a resume because the re-run is not the run "
                      "that was cut (an unseeded script, the script's own snapshot logic): fail (the job fails, "
                      "naming what differed) or restart (the script starts again from scratch, and the job's "
                      "events say so). A job spanning hosts always fails.",
            error_messages={"invalid_choice": RESUME_REFUSED_MESSAGE})
        network = serializers.ChoiceField(
            choices=Job.Network.choices, default=Job.Network.ISOLATED,
            help_text="isolated (the default): the job's ranks get a network namespace of their own with only "
                      "loopback, so they reach nothing outside the job (a job spanning hosts gets the node's "
                      "network, said in its events). host: the node's network, refused (400) unless the operator "
                      "set MERIDIAN_JOB_HOST_NETWORK=allow.",
            error_messages={"invalid_choice": NETWORK_MESSAGE})


    @extend_schema(request=InputSerializer, responses={201: JobOutputSerializer},
                   summary="Submit a job")
    def post(self, request):
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        spec = dict(serializer.validated_data)
        team = _team_for_submission(user=request.user, ref=spec.pop("team", None))
        job = job_submit(team=team, submitted_by=request.user, spec=spec)
        # The new job as job_submit returns it (team and submitter loaded, no region): reading it
        # back cost a query, and a pending job has no reasons that name other jobs to redact.
        return Response(JobOutputSerializer(job).data, status=status.HTTP_201_CREATED)


class JobBulkSubmitApi(APIView):
    """POST /api/jobs/bulk/: many jobs of one team at once (Slurm's --array), all or nothing.

    Its own URL rather than a list body to POST /api/jobs/: that one keeps one request and one
    answer shape (a job), and this answer is short (id, name, state per job) because serializing
    a thousand full jobs would cost more than creating them."""

    @extend_schema_serializer(component_name="JobBulkSubmitInput")
    class InputSerializer(StrictInputSerializer):
        team = serializers.CharField(
            required=False, help_text="Team slug or id; may be left out by a user on exactly one team.")
        jobs = serializers.ListField(
            child=serializers.DictField(), allow_empty=False,
            help_text="Job specs, each with the fields of POST /api/jobs/ but team; at most "
                      "MERIDIAN_MAX_BULK_JOBS (1000 by default). A 400 names each bad one by its index.")

    @extend_schema_serializer(component_name="JobBulkSubmitOutput")
    class OutputSerializer(serializers.Serializer):
        @extend_schema_serializer(component_name="JobBulkSubmitted")
        class JobRefSerializer(serializers.Serializer):
            id = serializers.IntegerField()
            name = serializers.CharField()
            state = serializers.CharField()

        count = serializers.IntegerField()
        jobs = JobRefSerializer(many=True)

    @extend_schema(request=InputSerializer, responses={201: OutputSerializer},
                   summary="Submit many jobs at once (all or nothing)")
    def post(self, request):
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        team = _team_for_submission(user=request.user, ref=serializer.validated_data.get("team"))
        try:
            jobs = jobs_submit_bulk(team=team, submitted_by=request.user, specs=serializer.validated_data["jobs"])
        except JobSpecsInvalid as error:
            raise ValidationError({"jobs": error.per_item}) from None
        return Response(self.OutputSerializer({"count": len(jobs), "jobs": jobs}).data, status=status.HTTP_201_CREATED)


def _team_for_submission(*, user, ref):
    teams = list(team_list_for_user(user=user))
    if ref is None:
        if len(teams) == 1:
            return teams[0]
        raise ValidationError({"team": [
            "say which team submits the job: one of "
            + (", ".join(t.slug for t in teams) or "(you are on no team; ask a team admin)")
        ]})
    for team in teams:
        if ref in {team.slug, str(team.pk)}:
            return team
    raise ValidationError({"team": [
        f'you are not on a team "{ref}"; your teams: ' + (", ".join(t.slug for t in teams) or "none")
    ]})


class JobListApi(APIView):
    pagination_class = MeridianPagination  # read by paginate() and by the schema (a paginated object)
    class FilterSerializer(serializers.Serializer):
        state = serializers.ChoiceField(
            choices=Job.State.choices, required=False, error_messages={"invalid_choice": STATE_MESSAGE}
        )
        tier = serializers.ChoiceField(
            choices=Tier.choices, required=False, error_messages={"invalid_choice": TIER_MESSAGE}
        )
        team = serializers.CharField(required=False, help_text="team slug or id")
        accelerator_type = serializers.ChoiceField(
            choices=ACCELERATOR_TYPE_CHOICES, required=False, error_messages={"invalid_choice": TYPE_MESSAGE}
        )

    @extend_schema(
        parameters=[FilterSerializer], responses={200: JobOutputSerializer(many=True)}, summary="List your teams' jobs"
    )
    def get(self, request):
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        jobs = job_list_visible(user=request.user, filters=filters.validated_data)
        return _redacted(request, paginate(self, jobs, JobOutputSerializer))


class JobDetailApi(APIView):
    @extend_schema(responses={200: JobOutputSerializer}, summary="Get a job")
    def get(self, request, job_id):
        job = job_get_visible_or_404(user=request.user, job_id=job_id)
        return _redacted(request, Response(JobOutputSerializer(job).data))


class JobCancelApi(APIView):
    @extend_schema(request=None, responses={200: JobOutputSerializer}, summary="Cancel a job")
    def post(self, request, job_id):
        job = job_get_visible_or_404(user=request.user, job_id=job_id)
        job_cancel(job=job, by=request.user)
        return _redacted(request, Response(JobOutputSerializer(job_get_visible(user=request.user, job_id=job_id)).data))


class JobEventListApi(APIView):
    pagination_class = MeridianPagination
    @extend_schema_serializer(component_name="JobEvent")
    class OutputSerializer(serializers.ModelSerializer):
        actor = serializers.CharField(source="actor.username", default=None, allow_null=True)

        class Meta:
            model = JobEvent
            fields = ["id", "type", "from_state", "to_state", "reason", "actor", "extra_data", "created_at"]

    @extend_schema(responses={200: OutputSerializer(many=True)}, summary="A job's timeline, oldest first")
    def get(self, request, job_id):
        job = job_get_visible_or_404(user=request.user, job_id=job_id)
        return _redacted(request, paginate(self, job_event_list(job=job), self.OutputSerializer))


class JobPlacementApi(APIView):
    @extend_schema_serializer(component_name="JobPlacement")
    class OutputSerializer(serializers.Serializer):
        host = serializers.CharField()
        first_rank = serializers.IntegerField()
        last_rank = serializers.IntegerField()
        devices = serializers.IntegerField(help_text="the job's devices on this host")
        utilization = serializers.FloatField(
            allow_null=True, help_text="mean latest utilization of those devices, 0..1 (GPUs: NVML's, "
                                       "the job's own; CPU slots: the node's busy fraction); null: none reported")
        memory_used_gb = serializers.FloatField(
            allow_null=True, help_text="device memory those devices use, GiB; null: not reported (CPU slots)")
        reporting = serializers.IntegerField(help_text="how many of those devices have a reading")
        read_at = serializers.DateTimeField(allow_null=True, help_text="the host's last telemetry")

    @extend_schema(responses={200: OutputSerializer(many=True)},
                   summary="Where a job runs now, per host in rank order, with its devices' latest readings")
    def get(self, request, job_id):
        job = job_get_visible_or_404(user=request.user, job_id=job_id)
        return Response(self.OutputSerializer(job_placement_now(job=job), many=True).data)


class TeamListApi(APIView):
    pagination_class = MeridianPagination
    @extend_schema_serializer(component_name="Team")
    class OutputSerializer(serializers.ModelSerializer):
        role = serializers.SerializerMethodField()
        usage = serializers.SerializerMethodField()

        class Meta:
            model = Team
            fields = ["id", "slug", "name", "quotas", "role", "usage"]

        def get_role(self, team) -> str | None:
            return self.context["roles"].get(team.pk)

        def get_usage(self, team) -> dict:
            return self.context["usage"][team.pk]

    @extend_schema(responses={200: OutputSerializer(many=True)}, summary="Your teams, roles, quotas and usage")
    def get(self, request):
        roles = dict(Membership.objects.filter(user_id=request.user.pk).values_list("team_id", "role"))
        paginator = MeridianPagination()
        teams = paginator.paginate_queryset(team_list_for_user(user=request.user).order_by("name"), request, view=self)
        context = {"roles": roles, "usage": team_usage_many(teams=teams)}
        return paginator.get_paginated_response(self.OutputSerializer(teams, many=True, context=context).data)


@extend_schema_serializer(component_name="PreemptionRequest")
class PreemptionOutputSerializer(serializers.ModelSerializer):
    @extend_schema_serializer(component_name="PreemptionJobSummary")
    class JobSummarySerializer(serializers.ModelSerializer):
        team = TeamRefSerializer()
        attained_sla_fraction = serializers.FloatField(allow_null=True)
        sla_target = serializers.FloatField()

        class Meta:
            model = Job
            fields = [
                "id", "name", "team", "tier", "state", "accelerator_type", "world_size", "device_count",
                "attained_sla_fraction", "sla_target", "last_checkpoint_step", "last_checkpoint_at", "progress_step",
            ]

    job = JobSummarySerializer()
    decided_by = serializers.CharField(source="decided_by.username", default=None, allow_null=True)
    can_decide = serializers.SerializerMethodField()

    class Meta:
        model = PreemptionRequest
        fields = [
            "id", "job", "reason", "lost_work_seconds", "extra_data", "state", "requested_at", "expires_at",
            "decided_by", "decided_at", "note", "can_decide",
        ]

    def get_can_decide(self, request) -> bool:
        return (
            request.state == PreemptionRequest.State.PENDING
            and request.job.team_id in self.context.get("approver_team_ids", ())
        )


class PreemptionListApi(APIView):
    pagination_class = MeridianPagination
    class FilterSerializer(serializers.Serializer):
        state = serializers.ChoiceField(choices=PreemptionRequest.State.choices, required=False)

    @extend_schema(
        parameters=[FilterSerializer],
        responses={200: PreemptionOutputSerializer(many=True)},
        summary="Preemption requests on your teams' jobs",
    )
    def get(self, request):
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        requests = preemption_list_visible(user=request.user, state=filters.validated_data.get("state"))
        context = {"approver_team_ids": approver_team_ids(user=request.user)}
        return _redacted(request, paginate(self, requests, PreemptionOutputSerializer, context=context))


class _PreemptionDecisionApi(APIView):
    decide = None

    @extend_schema_serializer(component_name="PreemptionDecisionInput")
    class InputSerializer(serializers.Serializer):
        note = serializers.CharField(max_length=2000, required=False, allow_blank=True, default="")

    def post(self, request, request_id):
        preemption = preemption_get_visible(user=request.user, request_id=request_id)
        if preemption is None:
            raise NotFound(f"no preemption request {request_id} on your teams' jobs")
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        type(self).decide(request=preemption, by=request.user, note=serializer.validated_data["note"])
        preemption = preemption_get_visible(user=request.user, request_id=request_id)
        context = {"approver_team_ids": approver_team_ids(user=request.user)}
        return _redacted(request, Response(PreemptionOutputSerializer(preemption, context=context).data))


class PreemptionApproveApi(_PreemptionDecisionApi):
    decide = staticmethod(preemption_approve)

    @extend_schema(
        request=_PreemptionDecisionApi.InputSerializer,
        responses={200: PreemptionOutputSerializer},
        summary="Approve a preemption (capacity managers)",
    )
    def post(self, request, request_id):
        return super().post(request, request_id)


class PreemptionDenyApi(_PreemptionDecisionApi):
    decide = staticmethod(preemption_deny)

    @extend_schema(
        request=_PreemptionDecisionApi.InputSerializer,
        responses={200: PreemptionOutputSerializer},
        summary="Deny a preemption (capacity managers)",
    )
    def post(self, request, request_id):
        return super().post(request, request_id)


class JobCollectionApi(JobListApi, JobSubmitApi):
    """/api/jobs/: GET is JobListApi.get, POST is JobSubmitApi.post (one class per action
    above; REST puts both actions on one URL)."""
