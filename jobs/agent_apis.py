"""The agent-facing API (one API class per action). Mounted at /api/agent/ (jobs/agent_urls.py).

Authentication: `Authorization: Node <token>` (the per-node token that registration returns).
A node reads and writes its own state only: an unknown or revoked token is a 401; asking for
another node's state is a 403; reporting on a job that is not placed on the node changes
nothing and comes back under "rejected"; so does a report of a stale placement generation, with
"fence": true (the agent kills that copy without a checkpoint).

Every body is a message of protocol.node, decoded by a ProtocolSerializer: a malformed field is
a 400 naming it (dotted: "jobs.0.step"), a newer protocol version a 400 naming "v".

  POST /api/agent/register/   Authorization: Enroll <enrollment token> (a new node: never an enrolled one)
                              or Node <node token> (the node registers again: same token, its hostname only)
       Registration -> 201 RegistrationAnswer
  POST /api/agent/heartbeat/  Heartbeat (see jobs.heartbeats.node_heartbeat_answer; answered before Django
                              when it certainly can be: jobs/heartbeat_api.py)
       -> 200 HeartbeatAnswer (desired: DesiredState, see jobs.workflows.node_desired_state_build;
          omitted while the heartbeat's desired_version is current: jobs/desired_version.py)
  GET  /api/agent/desired/                       -> 200 the node's DesiredState
  GET  /api/agent/nodes/<node_id>/desired/       -> the same for your own id; 403 for another node's
"""
from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.extensions import OpenApiAuthenticationExtension, OpenApiSerializerExtension
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed, PermissionDenied, ValidationError
from rest_framework.permissions import BasePermission
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from fleet.agent_services import node_enrollment_check, node_register, node_reregister
from fleet.models import Node
from fleet.selectors import node_get_by_token
from jobs.heartbeats import node_heartbeat_answer
from jobs.workflows import node_desired_state
from protocol import Message, ProtocolError
from protocol.node import DesiredState, Heartbeat, HeartbeatAnswer, Registration, RegistrationAnswer

NODE_SCHEME = b"node"
ENROLL_SCHEME = b"enroll"


def heartbeat_seconds():
    return settings.MERIDIAN_AGENT_HEARTBEAT_SECONDS


def _credentials(request, scheme):
    parts = get_authorization_header(request).split()
    if len(parts) != 2 or parts[0].lower() != scheme:
        return None
    return parts[1].decode(errors="replace")


class NodeTokenAuthentication(BaseAuthentication):
    """`Authorization: Node <token>` -> request.auth is the Node; 401 for a wrong or revoked token."""

    def authenticate(self, request):
        token = _credentials(request, NODE_SCHEME)
        if token is None:
            return None
        node = node_get_by_token(token=token)
        if node is None:
            raise AuthenticationFailed("unknown or revoked node token; register the agent again "
                                       "with the enrollment token")
        return AnonymousUser(), node

    def authenticate_header(self, request):
        return "Node"


class NodeTokenScheme(OpenApiAuthenticationExtension):
    target_class = "jobs.agent_apis.NodeTokenAuthentication"
    name = "nodeToken"

    def get_security_definition(self, auto_schema):
        return {"type": "apiKey", "in": "header", "name": "Authorization",
                "description": "Node <token>: the token registration returned"}


class IsNode(BasePermission):
    def has_permission(self, request, view):
        return isinstance(request.auth, Node)


class AgentApi(APIView):
    authentication_classes = [NodeTokenAuthentication]
    permission_classes = [IsNode]


class ProtocolSerializer(serializers.Serializer):
    """A request body that is one protocol message: `message.from_dict` is the one definition of
    its shape, so a malformed field is a 400 naming it ({"jobs.0.step": ["must be at least 0, not
    -1"]}), never a 500. validated_data is the decoded message."""

    message: type[Message]

    def to_internal_value(self, data):
        try:
            return self.message.from_dict(data)
        except ProtocolError as exc:
            raise ValidationError({exc.field or api_settings.NON_FIELD_ERRORS_KEY: [exc.problem]}) from None

    def to_representation(self, instance):
        return instance.to_dict()


class ProtocolSerializerExtension(OpenApiSerializerExtension):
    """Publishes a ProtocolSerializer in the generated OpenAPI schema as its message: a component
    named after it (Heartbeat, DesiredState, ...) with the message's own JSON Schema."""

    target_class = "jobs.agent_apis.ProtocolSerializer"
    match_subclasses = True

    def get_name(self, auto_schema, direction):
        return self.target.message.__name__

    def map_serializer(self, auto_schema, direction):
        return self.target.message.json_schema()


class RegistrationSerializer(ProtocolSerializer):
    message = Registration


class RegistrationAnswerSerializer(ProtocolSerializer):
    message = RegistrationAnswer


class HeartbeatSerializer(ProtocolSerializer):
    message = Heartbeat


class HeartbeatAnswerSerializer(ProtocolSerializer):
    message = HeartbeatAnswer


class DesiredStateSerializer(ProtocolSerializer):
    message = DesiredState


def _decoded(serializer_class: type[ProtocolSerializer], request) -> Message:
    serializer = serializer_class(data=request.data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


class NodeRegisterApi(APIView):
    authentication_classes = []
    permission_classes = []

    @extend_schema(request=RegistrationSerializer, responses={201: RegistrationAnswerSerializer},
                   summary="Enrol a node (Authorization: Enroll <enrollment token>) or register it again "
                           "(Authorization: Node <its own token>)")
    def post(self, request):
        enrollment = _credentials(request, ENROLL_SCHEME)
        node_token = _credentials(request, NODE_SCHEME)
        if enrollment is None and node_token is None:
            return Response({"detail": "send Authorization: Enroll <enrollment token> (a new node) or "
                                       "Node <node token> (this node, registering again)"},
                            status=status.HTTP_401_UNAUTHORIZED, headers={"WWW-Authenticate": "Enroll"})
        try:
            # Before the body: a caller without a valid token learns nothing of its shape.
            node = None
            if node_token is not None:
                node = node_get_by_token(token=node_token)
                if node is None:
                    return Response({"detail": "unknown or revoked node token; an admin re-enrols this node "
                                               "(manage.py fleet_node_token)"},
                                    status=status.HTTP_401_UNAUTHORIZED, headers={"WWW-Authenticate": "Node"})
            else:
                node_enrollment_check(enrollment=enrollment)
            registration = _decoded(RegistrationSerializer, request)
            described = dict(
                hostname=registration.hostname, region=registration.region, cluster=registration.cluster,
                rack=registration.rack, agent_version=registration.agent_version,
                devices=[{"type": d.type, "memory_gb": d.memory_gb, "uuid": d.uuid} for d in registration.devices])
            if node is not None:
                node, token = node_reregister(node=node, token=node_token, **described)
            else:
                node, token = node_register(enrollment=enrollment, **described)
        except DjangoPermissionDenied as exc:
            raise PermissionDenied(str(exc)) from None
        except DjangoValidationError as exc:
            raise ValidationError(exc.message_dict if hasattr(exc, "error_dict") else exc.messages) from None
        answer = RegistrationAnswer(node_id=node.pk, hostname=node.hostname, token=token,
                                    heartbeat_seconds=heartbeat_seconds())
        return Response(answer.to_dict(), status=status.HTTP_201_CREATED)


class NodeHeartbeatApi(AgentApi):
    @extend_schema(request=HeartbeatSerializer, responses={200: HeartbeatAnswerSerializer},
                   summary="Report telemetry and observed jobs; get the desired state")
    def post(self, request):
        heartbeat = _decoded(HeartbeatSerializer, request)
        wire = request.data if isinstance(request.data, dict) else None  # what the folder decodes again
        return Response(node_heartbeat_answer(node=request.auth, heartbeat=heartbeat, wire=wire).to_dict())


class NodeDesiredStateApi(AgentApi):
    @extend_schema(responses={200: DesiredStateSerializer}, summary="The node's desired state")
    def get(self, request, node_id=None):
        if node_id is not None and node_id != request.auth.pk:
            raise PermissionDenied("a node may read only its own desired state")
        return Response(node_desired_state(node=request.auth))
