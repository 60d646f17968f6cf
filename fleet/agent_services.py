"""Services for node agents: enrolment. (Reports and desired state: jobs/workflows.py.)"""
import hmac

from django.conf import settings
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.utils import timezone

from fleet.accelerator_types import ACCELERATOR_TYPES, accelerator_type_error
from fleet.models import Accelerator, Cluster, Node, Region
from fleet.services import node_token_issue
from protocol.node import MAX_DEVICES_PER_NODE

__all__ = ["MAX_DEVICES_PER_NODE", "enrollment_token", "enrollment_token_matches", "node_enrollment_check",
           "node_register"]


def enrollment_token():
    """Returns the bootstrap token agents present to register (MERIDIAN_AGENT_ENROLLMENT_TOKEN), or ""."""
    return settings.MERIDIAN_AGENT_ENROLLMENT_TOKEN


def enrollment_token_matches(token):
    expected = enrollment_token()
    return bool(expected) and bool(token) and hmac.compare_digest(expected.encode(), token.encode())


def node_enrollment_check(*, enrollment):
    """Returns None when `enrollment` is the deployment's enrollment token; raises PermissionDenied
    when it is not, or when enrollment is disabled (no token configured)."""
    if not enrollment_token():
        raise PermissionDenied("agent enrollment is disabled: set MERIDIAN_AGENT_ENROLLMENT_TOKEN on the "
                               "control plane and pass the same value to meridian-agent --enroll-token")
    if not enrollment_token_matches(enrollment):
        raise PermissionDenied("wrong enrollment token")


def node_register(*, enrollment, hostname, region, cluster, devices, rack="", agent_version=""):
    """Returns (node, token): the node for `hostname` (created or updated) and its new agent token.

    Raises PermissionDenied when `enrollment` is not the deployment's enrollment token (or none
    is configured), ValidationError for a bad device list. Registering again rotates the token
    (the old one stops working) and keeps the node's jobs; devices are matched by index.
    """
    node_enrollment_check(enrollment=enrollment)
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
    with transaction.atomic():
        region_row, _ = Region.objects.get_or_create(name=region.strip())
        cluster_row, _ = Cluster.objects.get_or_create(region=region_row, name=cluster.strip())
        node = Node.objects.select_for_update().filter(hostname=hostname.strip()).first()
        if node is None:
            node = Node.objects.create(cluster=cluster_row, hostname=hostname.strip(), rack=rack or "")
        elif node.cluster_id != cluster_row.pk:
            raise ValidationError({"cluster": f"node {hostname} is registered in cluster {node.cluster}; "
                                              "it cannot move to another cluster"})
        Node.objects.filter(pk=node.pk).update(agent_version=agent_version[:64], last_heartbeat=timezone.now(),
                                               state=Node.State.READY)
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
        token = node_token_issue(node=node)
    node.refresh_from_db()
    return node, token
