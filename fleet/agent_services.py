"""Services for node agents: enrolment and re-registration. (Reports and desired state: jobs/workflows.py.)

An enrollment token (a scoped, expiring EnrollmentToken, or in development the deployment's
MERIDIAN_AGENT_ENROLLMENT_TOKEN) creates nodes; it never hands over an enrolled node's identity.
An enrolled node re-registers with its own node token."""
import hmac
from dataclasses import dataclass

from django.conf import settings
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from fleet.accelerator_types import ACCELERATOR_TYPES, accelerator_type_error
from fleet.models import Accelerator, Cluster, EnrollmentToken, Node, Region, node_token_hash
from fleet.services import node_token_issue
from protocol.node import MAX_DEVICES_PER_NODE

__all__ = ["MAX_DEVICES_PER_NODE", "Enrollment", "enrollment_token", "enrollment_token_matches",
           "node_enrollment_check", "node_register", "node_reregister"]


def enrollment_token():
    """Returns the deployment's bootstrap enrollment token (MERIDIAN_AGENT_ENROLLMENT_TOKEN), or ""."""
    return settings.MERIDIAN_AGENT_ENROLLMENT_TOKEN


def enrollment_token_matches(token):
    expected = enrollment_token()
    return bool(expected) and bool(token) and hmac.compare_digest(expected.encode(), token.encode())


@dataclass(frozen=True)
class Enrollment:
    """What an enrollment token allows: new nodes in `cluster` (a scoped EnrollmentToken), or in
    any cluster (`token` None: the deployment's bootstrap token of the embedded run and tests)."""

    token: EnrollmentToken | None = None

    @property
    def cluster(self) -> Cluster | None:
        return self.token.cluster if self.token is not None else None


def node_enrollment_check(*, enrollment, now=None) -> Enrollment:
    """Returns what the enrollment token `enrollment` allows; raises PermissionDenied for a wrong,
    revoked or expired token, and for the bootstrap token (MERIDIAN_AGENT_ENROLLMENT_TOKEN) in the
    production profile, where every enrollment token is scoped and expires."""
    now = now or timezone.now()
    if enrollment_token_matches(enrollment):
        if settings.PRODUCTION:
            raise PermissionDenied("MERIDIAN_AGENT_ENROLLMENT_TOKEN is not accepted in the production profile: "
                                   "enrol with a scoped, expiring token from `manage.py fleet_enrollment_token`")
        return Enrollment()
    row = (EnrollmentToken.objects.select_related("cluster", "cluster__region")
           .filter(token_hash=node_token_hash(enrollment or "")).first()) if enrollment else None
    if row is None:
        if not enrollment_token() and not EnrollmentToken.objects.exists():
            raise PermissionDenied("agent enrollment is disabled: create an enrollment token with "
                                   "`manage.py fleet_enrollment_token --cluster REGION/CLUSTER` (or set "
                                   "MERIDIAN_AGENT_ENROLLMENT_TOKEN for a development run) and give it to the agent "
                                   "in MERIDIAN_AGENT_ENROLL_TOKEN")
        raise PermissionDenied("wrong enrollment token")
    reason = row.unusable_reason(now)
    if reason:
        raise PermissionDenied(reason)
    return Enrollment(token=row)


def _registration_errors(*, hostname, region, cluster, devices):
    errors = {}
    if not isinstance(hostname, str) or not hostname.strip() or len(hostname) > 253:
        errors["hostname"] = "hostname is required (at most 253 characters)"
    for key, value in (("region", region), ("cluster", cluster)):
        if not isinstance(value, str) or not value.strip():
            errors[key] = f"{key} is required, e.g. 'local'"
    if not isinstance(devices, list) or not 1 <= len(devices) <= MAX_DEVICES_PER_NODE:
        errors["devices"] = f"devices must be a list of 1..{MAX_DEVICES_PER_NODE} objects with a type"
    else:
        for i, device in enumerate(devices):
            error = accelerator_type_error(device.get("type") if isinstance(device, dict) else None)
            if error:
                errors[f"devices[{i}]"] = error
    if errors:
        raise ValidationError(errors)


def _devices_record(*, node, devices, agent_version, now):
    # a drained node stays draining when its agent restarts and registers again
    Node.objects.filter(pk=node.pk).update(agent_version=agent_version[:64], last_heartbeat=now,
                                           state=Node.alive_state())
    existing = {a.index: a for a in Accelerator.objects.filter(node=node)}
    for i, device in enumerate(devices):
        memory = int(device.get("memory_gb") or ACCELERATOR_TYPES[device["type"]].memory_gb)
        if i in existing:
            Accelerator.objects.filter(pk=existing[i].pk).update(
                type=device["type"], memory_gb=memory, uuid=str(device.get("uuid") or ""), healthy=True)
        else:
            Accelerator.objects.create(node=node, index=i, type=device["type"], memory_gb=memory,
                                       uuid=str(device.get("uuid") or ""))
    # devices that disappeared since the last registration may not be given to jobs
    Accelerator.objects.filter(node=node, index__gte=len(devices)).update(healthy=False)


def node_register(*, enrollment, hostname, region, cluster, devices, rack="", agent_version="", now=None):
    """Returns (node, token): a node enrolled with the enrollment token `enrollment` and its new
    agent token.

    The node is new, or one described in the database (fleet_load) that never enrolled. An
    enrolled node is never handed over: registering its hostname again with an enrollment token is
    refused (PermissionDenied); it re-registers with its own token (node_reregister), and an admin
    re-enrols it (`manage.py fleet_node_token`, or node_enrollment_allow). A scoped token enrols
    into its own cluster only. Raises PermissionDenied for a token that does not allow this,
    ValidationError for a bad device list; devices are matched by index.
    """
    now = now or timezone.now()
    grant = node_enrollment_check(enrollment=enrollment, now=now)
    _registration_errors(hostname=hostname, region=region, cluster=cluster, devices=devices)
    scope = grant.cluster
    if scope is not None and (scope.region.name, scope.name) != (region.strip(), cluster.strip()):
        raise PermissionDenied(f"this enrollment token enrols nodes into cluster {scope.region.name}/{scope.name} "
                               f"only: start the agent with --region {scope.region.name} --cluster {scope.name}")
    with transaction.atomic():
        region_row, _ = Region.objects.get_or_create(name=region.strip())
        cluster_row, _ = Cluster.objects.get_or_create(region=region_row, name=cluster.strip())
        node = Node.objects.select_for_update().filter(hostname=hostname.strip()).first()
        if node is None:
            node = Node.objects.create(cluster=cluster_row, hostname=hostname.strip(), rack=rack or "")
        elif node.enrolled_at is not None or node.agent_token_hash:
            raise PermissionDenied(f"node {node.hostname} is enrolled already: its agent registers with its own "
                                   "node token; to enrol a reinstalled node an admin issues it a new token "
                                   f"(manage.py fleet_node_token {node.hostname}) or allows it to enrol again "
                                   f"(manage.py fleet_node_token --allow-enrollment {node.hostname})")
        elif node.cluster_id != cluster_row.pk:
            raise ValidationError({"cluster": f"node {hostname} is registered in cluster {node.cluster}; "
                                              "it cannot move to another cluster"})
        _devices_record(node=node, devices=devices, agent_version=agent_version, now=now)
        token = node_token_issue(node=node)
        if grant.token is not None:
            EnrollmentToken.objects.filter(pk=grant.token.pk).update(last_used_at=now,
                                                                     nodes_enrolled=F("nodes_enrolled") + 1)
    node.refresh_from_db()
    return node, token


def node_reregister(*, node, token, hostname, region, cluster, devices, rack="", agent_version="", now=None):
    """Returns (node, token): `node` (authenticated by its own agent token `token`) registered again
    with its current devices; the token stays the same (a lost answer must not lock the node out).

    Raises PermissionDenied when `hostname` is not the node's own (a token speaks for its node
    only), ValidationError for a bad device list or another cluster."""
    now = now or timezone.now()
    _registration_errors(hostname=hostname, region=region, cluster=cluster, devices=devices)
    if hostname.strip() != node.hostname:
        raise PermissionDenied(f"this node token belongs to node {node.hostname}, not {hostname.strip()}")
    with transaction.atomic():
        node = Node.objects.select_for_update().select_related("cluster", "cluster__region").get(pk=node.pk)
        if (node.cluster.region.name, node.cluster.name) != (region.strip(), cluster.strip()):
            raise ValidationError({"cluster": f"node {hostname} is registered in cluster {node.cluster}; "
                                              "it cannot move to another cluster"})
        _devices_record(node=node, devices=devices, agent_version=agent_version, now=now)
    node.refresh_from_db()
    return node, token
