"""REST API of the fleet for signed-in users (the agent-facing API is the control loop's): reads
for everyone, summaries aggregated in the database, lists paginated; draining and undraining a
node for global admins only (fleet.services.user_is_fleet_operator): 403 for anyone else, 404 for
an unknown node, 409 for a lost one, 400 for a missing or over-long reason."""
from django.db.models import Prefetch
from django.utils import timezone
from drf_spectacular.utils import extend_schema, extend_schema_serializer, inline_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import APIException, NotFound
from rest_framework.response import Response
from rest_framework.views import APIView

from fleet.accelerator_types import ACCELERATOR_TYPE_CHOICES, ACCELERATOR_TYPES
from fleet.models import NODE_DRAIN_REASON_MAX_LENGTH, Accelerator, Cluster, Node, Region
from fleet.pagination import MeridianPagination, paginate
from fleet.selectors import (
    RESOLUTION_NAMES,
    TELEMETRY_MAX_POINTS,
    accelerator_list,
    fleet_summary,
    node_list,
    telemetry_series,
    telemetry_window,
)
from fleet.services import NodeStateConflict, node_drain, node_operator_check, node_undrain

TYPE_MESSAGE = 'unknown accelerator type "{input}"; known types: ' + ", ".join(ACCELERATOR_TYPES)
MAX_ID = 2**63 - 1  # ids are 64-bit: a larger filter would overflow the database's integer


def _id_filter(what):
    return serializers.IntegerField(
        required=False, min_value=1, max_value=MAX_ID, help_text=f"{what} id",
        error_messages={"min_value": f"a {what} id is at least 1", "max_value": f"a {what} id is at most {MAX_ID}"})


class FleetSummaryApi(APIView):
    @extend_schema(
        summary="Fleet totals, by accelerator type and by cluster",
        responses={200: inline_serializer("FleetSummary", fields={
            "totals": serializers.DictField(),
            "by_type": serializers.ListField(child=serializers.DictField()),
            "clusters": serializers.ListField(child=serializers.DictField()),
        })},
    )
    def get(self, request):
        return Response(fleet_summary())


@extend_schema_serializer(component_name="Node")
class NodeOutputSerializer(serializers.ModelSerializer):
    cluster = serializers.CharField(source="cluster.name")
    cluster_id = serializers.IntegerField()
    region = serializers.CharField(source="cluster.region.name")
    accelerator_count = serializers.IntegerField()
    healthy_count = serializers.IntegerField()
    has_agent_token = serializers.SerializerMethodField()
    jobs_holding_devices = serializers.IntegerField(
        help_text="jobs whose replicas still hold devices on the node (a drain is done when it is 0)")

    class Meta:
        model = Node
        fields = [
            "id", "hostname", "region", "cluster", "cluster_id", "rack", "nvlink_domain", "state",
            "last_heartbeat", "agent_version", "utilization", "telemetry_at", "accelerator_count",
            "healthy_count", "has_agent_token", "drain_reason", "drained_by", "drained_at", "jobs_holding_devices",
        ]

    def get_has_agent_token(self, node) -> bool:
        return bool(node.agent_token_hash)


class NodeListApi(APIView):
    pagination_class = MeridianPagination  # the schema then documents the paginated object
    class FilterSerializer(serializers.Serializer):
        hostname = serializers.CharField(required=False, max_length=253, help_text="exact hostname")
        region = serializers.CharField(required=False, max_length=64)
        cluster = _id_filter("cluster")
        state = serializers.ChoiceField(choices=Node.State.choices, required=False)

    @extend_schema(
        parameters=[FilterSerializer], responses={200: NodeOutputSerializer(many=True)}, summary="List nodes"
    )
    def get(self, request):
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        return paginate(self, node_list(filters=filters.validated_data), NodeOutputSerializer)


@extend_schema_serializer(component_name="Accelerator")
class AcceleratorOutputSerializer(serializers.ModelSerializer):
    hostname = serializers.CharField(source="node.hostname")
    cluster_id = serializers.IntegerField(source="node.cluster_id")
    region = serializers.CharField(source="node.cluster.region.name")

    class Meta:
        model = Accelerator
        fields = [
            "id", "node", "hostname", "cluster_id", "region", "index", "type", "memory_gb", "healthy", "uuid",
            "utilization", "memory_used_gb",
        ]


class NodeDetailApi(APIView):
    @extend_schema_serializer(component_name="NodeDetail")
    class OutputSerializer(NodeOutputSerializer):
        accelerators = AcceleratorOutputSerializer(many=True)

        class Meta(NodeOutputSerializer.Meta):
            fields = NodeOutputSerializer.Meta.fields + ["accelerators"]

    @extend_schema(responses={200: OutputSerializer}, summary="Get a node and its accelerators")
    def get(self, request, node_id):
        node = (
            node_list()
            .prefetch_related(
                Prefetch("accelerators", queryset=Accelerator.objects.select_related("node__cluster__region"))
            )
            .filter(pk=node_id)
            .first()
        )
        if node is None:
            raise NotFound(f"no node {node_id}")
        return Response(self.OutputSerializer(node).data)


class Conflict(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "conflict"


def _node_or_404(node_id):
    node = Node.objects.filter(pk=node_id).first()
    if node is None:
        raise NotFound(f"no node {node_id}; GET /api/nodes/?hostname=... finds a node's id")
    return node


def _node_output(node):
    return NodeOutputSerializer(node_list().get(pk=node.pk)).data


# DRF formats these with str.format: no braces
DRAIN_REASON_MISSING = "say why the node is drained (the next operator reads it), e.g. reason = 'replace GPU 3'"


class NodeDrainApi(APIView):
    """Drains a node (kubectl drain, scontrol state=drain): the next tick moves its jobs off by live
    migration and places nothing new there. Idempotent."""

    @extend_schema_serializer(component_name="NodeDrainInput")
    class InputSerializer(serializers.Serializer):
        reason = serializers.CharField(
            max_length=NODE_DRAIN_REASON_MAX_LENGTH, help_text="why (shown on the node's page and in the API)",
            error_messages={"required": DRAIN_REASON_MISSING, "blank": DRAIN_REASON_MISSING,
                            "max_length": f"at most {NODE_DRAIN_REASON_MAX_LENGTH} characters"})

    @extend_schema(request=InputSerializer, responses={200: NodeOutputSerializer},
                   summary="Drain a node: move its jobs off, place nothing new on it (global admins)")
    def post(self, request, node_id):
        node = _node_or_404(node_id)
        node_operator_check(request.user, "drain")  # a 403 before any word on the body
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        try:
            node_drain(node=node, by=request.user, reason=serializer.validated_data["reason"])
        except NodeStateConflict as error:
            raise Conflict(str(error)) from None
        return Response(_node_output(node))


class NodeUndrainApi(APIView):
    """Undrains a node (kubectl uncordon, scontrol state=resume): jobs may be placed on it again.
    Idempotent."""

    @extend_schema(request=None, responses={200: NodeOutputSerializer},
                   summary="Undrain a node: let jobs be placed on it again (global admins)")
    def post(self, request, node_id):
        node = _node_or_404(node_id)
        try:
            node_undrain(node=node, by=request.user)
        except NodeStateConflict as error:
            raise Conflict(str(error)) from None
        return Response(_node_output(node))


class AcceleratorListApi(APIView):
    pagination_class = MeridianPagination
    class FilterSerializer(serializers.Serializer):
        node = _id_filter("node")
        type = serializers.ChoiceField(
            choices=ACCELERATOR_TYPE_CHOICES, required=False, error_messages={"invalid_choice": TYPE_MESSAGE}
        )
        healthy = serializers.BooleanField(required=False, allow_null=True, default=None)
        region = serializers.CharField(required=False, max_length=64)
        cluster = _id_filter("cluster")

    @extend_schema(
        parameters=[FilterSerializer],
        responses={200: AcceleratorOutputSerializer(many=True)},
        summary="List accelerators (paginated)",
    )
    def get(self, request):
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        return paginate(self, accelerator_list(filters=filters.validated_data), AcceleratorOutputSerializer)


class TelemetrySeriesApi(APIView):
    """Utilization and memory over time of the fleet, a region, a cluster, a node or an
    accelerator type (any combination but node with region/cluster), from the rollups."""

    class FilterSerializer(serializers.Serializer):
        node = _id_filter("node")
        cluster = _id_filter("cluster")
        region = serializers.CharField(required=False, max_length=64)
        accelerator_type = serializers.ChoiceField(choices=ACCELERATOR_TYPE_CHOICES, required=False,
                                                   error_messages={"invalid_choice": TYPE_MESSAGE})
        since = serializers.DateTimeField(required=False, help_text="ISO 8601; default: until - hours")
        until = serializers.DateTimeField(required=False, help_text="ISO 8601; default: now")
        hours = serializers.FloatField(required=False, min_value=1 / 60, max_value=24 * 366,
                                       help_text="window length ending at until (default 6)")
        resolution = serializers.ChoiceField(
            choices=list(RESOLUTION_NAMES), required=False,
            error_messages={"invalid_choice": '"{input}" is not a resolution; use minute or hour'},
            help_text=f"default: minute up to 24 h, else hour; at most {TELEMETRY_MAX_POINTS:,} buckets")

        def validate(self, attrs):
            if attrs.get("node") and (attrs.get("cluster") or attrs.get("region")):
                raise serializers.ValidationError({"node": "a node is its own scope; drop cluster and region"})
            return attrs

    class PointSerializer(serializers.Serializer):
        t = serializers.DateTimeField(help_text="bucket start")
        utilization_mean = serializers.FloatField(help_text="mean over device readings, 0..1")
        utilization_max = serializers.FloatField()
        memory_used_gb_mean = serializers.FloatField(help_text="per device")
        memory_used_gb_max = serializers.FloatField()
        device_samples = serializers.IntegerField()

    class OutputSerializer(serializers.Serializer):
        scope = serializers.DictField()
        since = serializers.DateTimeField()
        until = serializers.DateTimeField()
        resolution = serializers.CharField()
        resolution_seconds = serializers.IntegerField()
        points = serializers.ListField(child=serializers.DictField())

    @extend_schema(parameters=[FilterSerializer], responses={200: OutputSerializer},
                   summary="Utilization and memory over time (downsampled history)")
    def get(self, request):
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        params = filters.validated_data
        node_id, cluster_id, region = params.get("node"), params.get("cluster"), params.get("region")
        if node_id and not Node.objects.filter(pk=node_id).exists():
            raise NotFound(f"no node {node_id}")
        if cluster_id and not Cluster.objects.filter(pk=cluster_id).exists():
            raise NotFound(f"no cluster {cluster_id}")
        if region and not Region.objects.filter(name=region).exists():
            raise NotFound(f'no region named "{region}"')
        since, until, seconds = telemetry_window(
            now=timezone.now(), since=params.get("since"), until=params.get("until"), hours=params.get("hours"),
            resolution=params.get("resolution"), node_level=node_id is not None)
        scope = {"node": node_id, "cluster": cluster_id, "region": region,
                 "accelerator_type": params.get("accelerator_type")}
        points = telemetry_series(since=since, until=until, resolution=seconds, node_id=node_id,
                                  cluster_id=cluster_id, region=region,
                                  accelerator_type=params.get("accelerator_type"))
        resolution = next(name for name, value in RESOLUTION_NAMES.items() if value == seconds)
        return Response(self.OutputSerializer({
            "scope": {k: v for k, v in scope.items() if v}, "since": since, "until": until,
            "resolution": resolution, "resolution_seconds": seconds,
            "points": self.PointSerializer(points, many=True).data}).data)
