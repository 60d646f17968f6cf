"""The HTTP edge of code bundles and job outputs (services in jobs/bundles.py).

  PUT  /api/bundles/<sha256>/     body: the .tar.gz (application/octet-stream), streamed to disk
       -> 201 (new bytes) or 200 (already stored: stored once); 413 above MERIDIAN_BUNDLE_MAX_BYTES;
          400 naming "sha256" (the body hashes to something else) or "bundle" (a refused archive)
  HEAD /api/bundles/<sha256>/     200 when you uploaded it, else 404 (ask before sending it)
  GET  /api/bundles/<sha256>/     its size and entries, same 404 rule
  GET  /api/jobs/<id>/outputs/    the job's workspace files as a .tar.gz stream (its end, or
                                  its newest checkpoint before that); 404 when none was saved yet
  GET  /api/agent/bundles/<sha256>/   (Authorization: Node <token>) the bundle's bytes, only for a
                                  bundle of a job placed on that node; 404 otherwise
"""
from django.conf import settings
from django.http import FileResponse, StreamingHttpResponse
from django.utils import timezone
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import exceptions, serializers, status
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs.agent_apis import AgentApi
from jobs.bundles import (
    BundleTooLarge,
    bundle_get_for_user,
    bundle_path_for_node,
    bundle_store,
    job_outputs_expired,
    job_outputs_manifest,
    job_outputs_tar,
)
from jobs.selectors import job_get_visible_or_404
from protocol.bundle import is_sha256


class BundleTooLargeError(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "bundle_too_large"


class BundleOutputSerializer(serializers.Serializer):
    sha256 = serializers.CharField()
    size_bytes = serializers.IntegerField()
    unpacked_bytes = serializers.IntegerField()
    entries = serializers.IntegerField()
    created = serializers.BooleanField(required=False)


def _check_digest(sha256):
    if not is_sha256(sha256):
        raise ValidationError({"sha256": [f"{sha256[:80]!r} is not a sha256 digest: 64 lowercase hex digits, "
                                          f"the sha256 of the .tar.gz file"]})


class BundleDetailApi(APIView):
    def _visible(self, request, sha256):
        _check_digest(sha256)
        bundle = bundle_get_for_user(user=request.user, sha256=sha256)
        if bundle is None:
            raise NotFound(f"no bundle {sha256[:12]}… uploaded by you; PUT it to this URL")
        return bundle

    @extend_schema(responses={200: BundleOutputSerializer}, summary="A bundle you uploaded")
    def get(self, request, sha256):
        return Response(BundleOutputSerializer(self._visible(request, sha256)).data)

    @extend_schema(request={"application/octet-stream": bytes},
                   responses={201: BundleOutputSerializer, 200: BundleOutputSerializer,
                              413: OpenApiResponse(description="above MERIDIAN_BUNDLE_MAX_BYTES")},
                   summary="Upload a code bundle (.tar.gz) under its sha256")
    def put(self, request, sha256):
        _check_digest(sha256)
        declared = request.META.get("CONTENT_LENGTH")
        try:
            bundle, created = bundle_store(
                stream=request._request, sha256=sha256, user=request.user,
                declared_length=int(declared) if declared and declared.isdigit() else None)
        except BundleTooLarge as exc:
            raise BundleTooLargeError(str(exc)) from None
        data = dict(BundleOutputSerializer(bundle).data, created=created)
        return Response(data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


class JobOutputsApi(APIView):
    @extend_schema(responses={(200, "application/gzip"): bytes}, summary="Download a job's outputs (.tar.gz)")
    def get(self, request, job_id):
        job = job_get_visible_or_404(user=request.user, job_id=job_id)
        manifest = job_outputs_manifest(job=job)
        if manifest is None and job_outputs_expired(job=job, now=timezone.now()):
            raise NotFound(f"job {job.pk} ended on {job.finished_at:%Y-%m-%d}; its saved outputs were deleted after "
                           f"the retention of {settings.MERIDIAN_OUTPUTS_RETENTION_DAYS:g} days "
                           f"(MERIDIAN_OUTPUTS_RETENTION_DAYS)")
        if manifest is None:
            raise NotFound(f"job {job.pk} has no saved outputs yet: a job's workspace is saved with each "
                           f"checkpoint and when it ends (state now: {job.state})")
        response = StreamingHttpResponse(job_outputs_tar(job=job, manifest=manifest), content_type="application/gzip")
        response["Content-Disposition"] = f'attachment; filename="job-{job.pk}-outputs.tar.gz"'
        response["X-Meridian-Outputs"] = "final" if manifest["source"] == "final.json" else "latest-checkpoint"
        if "step" in manifest:
            response["X-Meridian-Outputs-Step"] = str(manifest["step"])
        return response


class AgentBundleApi(AgentApi):
    @extend_schema(responses={(200, "application/gzip"): bytes}, summary="Fetch a bundle of a job on this node")
    def get(self, request, sha256):
        _check_digest(sha256)
        path = bundle_path_for_node(node=request.auth, sha256=sha256)
        if path is None:
            raise NotFound(f"no job placed on this node uses bundle {sha256[:12]}…")
        return FileResponse(open(path, "rb"), content_type="application/gzip")
