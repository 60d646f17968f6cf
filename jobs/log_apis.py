"""The log APIs: agents ship rank output; members read a job's log.

  POST /api/agent/logs/          (Authorization: Node <token>) LogBatch -> 200 LogBatchAnswer
  GET  /api/jobs/<id>/logs/?rank=&after=&limit=&tail=
       -> 200 {"chunks": [...], "next": <cursor>, "world_size": W}

GET is team-visible like the job itself (another team's job is a 404). `after` is the cursor
(the "next" of the previous answer; 0 for the start); `rank` keeps one rank's output (markers,
which concern every rank, stay); `tail=1` returns the newest `limit` chunks instead of the
oldest after the cursor (a page opening on a long log). Bad parameters are a 400 naming them.
"""
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs.agent_apis import AgentApi, ProtocolSerializer, _decoded
from jobs.logs import DEFAULT_PAGE, MAX_PAGE, log_batch_record, log_chunks_list
from jobs.models import LogChunk
from jobs.selectors import job_get_visible_or_404
from protocol.logs import LogBatch, LogBatchAnswer


class LogBatchSerializer(ProtocolSerializer):
    message = LogBatch


class LogBatchAnswerSerializer(ProtocolSerializer):
    message = LogBatchAnswer


class NodeLogsApi(AgentApi):
    @extend_schema(request=LogBatchSerializer, responses={200: LogBatchAnswerSerializer},
                   summary="Ship rank output of jobs placed on this node")
    def post(self, request):
        batch = _decoded(LogBatchSerializer, request)
        return Response(log_batch_record(node=request.auth, batch=batch).to_dict())


def _int_param(request, name, *, default, minimum, maximum=None):
    raw = request.query_params.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValidationError({name: [f"must be an integer, not {raw!r}"]}) from None
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
        raise ValidationError({name: [f"must be {bounds}, not {value}"]})
    return value


class JobLogListApi(APIView):
    class ChunkSerializer(serializers.ModelSerializer):
        seq = serializers.IntegerField(source="id")

        class Meta:
            model = LogChunk
            fields = ["seq", "kind", "rank", "stream", "generation", "attempt", "text", "created_at"]

    @extend_schema(parameters=[
        OpenApiParameter("rank", int, description="one rank's output (and the markers)"),
        OpenApiParameter("after", int, description="cursor: the previous answer's next (0: the start)"),
        OpenApiParameter("limit", int, description=f"chunks per answer (1..{MAX_PAGE}, default {DEFAULT_PAGE})"),
        OpenApiParameter("tail", bool, description="the newest `limit` chunks instead"),
    ], summary="A job's log across all its attempts, from a cursor")
    def get(self, request, job_id):
        job = job_get_visible_or_404(user=request.user, job_id=job_id)
        rank = _int_param(request, "rank", default=None, minimum=0, maximum=job.world_size - 1)
        after = _int_param(request, "after", default=0, minimum=0)
        limit = _int_param(request, "limit", default=DEFAULT_PAGE, minimum=1, maximum=MAX_PAGE)
        tail = request.query_params.get("tail", "").lower()
        if tail not in ("", "0", "1", "true", "false"):
            raise ValidationError({"tail": [f"must be 1 or 0, not {tail!r}"]})
        chunks = log_chunks_list(job=job, rank=rank, after=after, limit=limit, tail=tail in ("1", "true"))
        return Response({"chunks": self.ChunkSerializer(chunks, many=True).data,
                         "next": chunks[-1].pk if chunks else after, "world_size": job.world_size,
                         "state": job.state})
