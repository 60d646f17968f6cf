"""The agent-facing API (one API class per action). Mounted at /api/agent/ (jobs/agent_urls.py).

Authentication: `Authorization: Node <token>` (the per-node token that registration returns).
A node reads and writes its own state only: an unknown or revoked token is a 401; asking for
another node's state is a 403; reporting on a job that is not placed on the node changes
nothing and comes back under "rejected"; so does a report of a stale placement generation, with
"fence": true (the agent kills that copy without a checkpoint).

  POST /api/agent/register/   Authorization: Enroll <enrollment token>
       {"hostname", "region", "cluster", "rack", "agent_version", "devices": [{"type", "memory_gb", "uuid"}]}
       -> 201 {"node_id", "token", "heartbeat_seconds"}
  POST /api/agent/heartbeat/  {"telemetry": {...}, "jobs": [...]}   (see jobs.workflows.node_report_apply)
       -> 200 {"accepted", "rejected", "deferred", "desired": <desired state (jobs.workflows.node_desired_state)>}
  GET  /api/agent/desired/                       -> 200 the node's desired state
  GET  /api/agent/nodes/<node_id>/desired/       -> the same for your own id; 403 for another node's
"""
from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import status
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed, PermissionDenied, ValidationError
from rest_framework.permissions import BasePermission
from rest_framework.response import Response
from rest_framework.views import APIView

from fleet.agent_services import node_register
from fleet.models import Node
from fleet.selectors import node_get_by_token
from jobs.workflows import node_desired_state, node_report_apply

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


class IsNode(BasePermission):
    def has_permission(self, request, view):
        return isinstance(request.auth, Node)


class AgentApi(APIView):
    authentication_classes = [NodeTokenAuthentication]
    permission_classes = [IsNode]


class NodeRegisterApi(APIView):
    authentication_classes = []
    permission_classes = []

    def post(self, request):
        enrollment = _credentials(request, ENROLL_SCHEME)
        if enrollment is None:
            return Response({"detail": "send Authorization: Enroll <enrollment token>"},
                            status=status.HTTP_401_UNAUTHORIZED, headers={"WWW-Authenticate": "Enroll"})
        body = request.data if isinstance(request.data, dict) else {}
        try:
            node, token = node_register(
                enrollment=enrollment, hostname=body.get("hostname"), region=body.get("region", "local"),
                cluster=body.get("cluster", "default"), devices=body.get("devices"),
                rack=str(body.get("rack") or ""), agent_version=str(body.get("agent_version") or ""))
        except DjangoPermissionDenied as exc:
            raise PermissionDenied(str(exc)) from None
        except DjangoValidationError as exc:
            raise ValidationError(exc.message_dict if hasattr(exc, "error_dict") else exc.messages) from None
        return Response({"node_id": node.pk, "hostname": node.hostname, "token": token,
                         "heartbeat_seconds": heartbeat_seconds()}, status=status.HTTP_201_CREATED)


class NodeHeartbeatApi(AgentApi):
    def post(self, request):
        body = request.data if isinstance(request.data, dict) else None
        if body is None:
            raise ValidationError({"detail": "a heartbeat is a JSON object: {telemetry, jobs}"})
        if not isinstance(body.get("jobs", []), list):
            raise ValidationError({"jobs": "jobs must be a list of observed jobs"})
        # node_report_apply keeps request.auth up to date (state, last heartbeat): no re-read.
        result = node_report_apply(node=request.auth, report=body)
        return Response({**result, "desired": node_desired_state(node=request.auth),
                         "heartbeat_seconds": heartbeat_seconds()})


class NodeDesiredStateApi(AgentApi):
    def get(self, request, node_id=None):
        if node_id is not None and node_id != request.auth.pk:
            raise PermissionDenied("a node may read only its own desired state")
        return Response(node_desired_state(node=request.auth))
