"""API errors a person can act on, never a 500 for bad input.

`exception_handler` maps what services raise onto HTTP:
  django ValidationError → 400 {field: [message]}      PermissionDenied → 403
  IllegalTransition → 409 {"detail": ...}             RequestDataTooBig → 413
  the database too busy to answer in time (SQLite's write lock held past its timeout, no pooled
  PostgreSQL connection free) → 503 {"detail": ...} with Retry-After: load, not a bug
  anything else (a bug) → 500 {"detail": ...} as JSON, logged with its traceback
`BoundedJSONParser` refuses bodies above DATA_UPLOAD_MAX_MEMORY_SIZE with a 413
(DRF's own JSON parser reads the stream without that limit) and JSON nested deeper than
MAX_JSON_DEPTH with a 400 (Python's parser would raise RecursionError near depth 1000).
"""
import json
import logging

from django.conf import settings
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import OperationalError
from rest_framework import exceptions, status
from rest_framework.parsers import JSONParser
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler
from rest_framework.views import set_rollback

logger = logging.getLogger(__name__)

# No API body of Meridian nests deeper than a few levels (a job spec: object → env → value).
MAX_JSON_DEPTH = 32


def json_depth_exceeds(value, limit=MAX_JSON_DEPTH) -> bool:
    """True when `value` (parsed JSON) nests lists and objects more than `limit` deep; iterative,
    so a hostile body cannot exhaust the stack here either."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


class PayloadTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "payload_too_large"

    def __init__(self, limit):
        super().__init__(
            f"request body is larger than {limit} bytes; send a smaller JSON body "
            f"(large inputs belong in files the job reads, not in args or env)"
        )


class BoundedJSONParser(JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        request = (parser_context or {}).get("request")
        declared = request.META.get("CONTENT_LENGTH") if request is not None else None
        if declared and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(limit)
        try:
            raw = stream.read(limit + 1) if stream is not None else b""
        except RequestDataTooBig:
            raise PayloadTooLarge(limit) from None
        if len(raw) > limit:
            raise PayloadTooLarge(limit)
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            parsed = json.loads(raw.decode(encoding))
        except RecursionError:
            raise exceptions.ParseError(f"JSON nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise exceptions.ParseError(
                f"malformed JSON: {exc}; send a JSON object such as {{\"name\": \"demo\"}}"
            ) from exc
        if json_depth_exceeds(parsed):
            raise exceptions.ParseError(f"JSON nested too deeply (at most {MAX_JSON_DEPTH} levels)")
        return parsed


# What OperationalError says when the database is only busy: SQLite's lock timeout, and
# psycopg_pool's PoolTimeout (Django wraps it when no pooled connection frees up in time).
BUSY_MESSAGES = ("database is locked", "couldn't get a connection")
RETRY_AFTER_S = 2


def database_busy(exc) -> bool:
    return isinstance(exc, OperationalError) and any(text in str(exc) for text in BUSY_MESSAGES)


def _validation_error_data(error):
    if hasattr(error, "message_dict"):
        return {field: list(messages) for field, messages in error.message_dict.items()}
    return {"detail": " ".join(error.messages)}


BUSY_DETAIL = (f"the control plane's database is busy; the request was not completed, retry in "
               f"{RETRY_AFTER_S} s")
INTERNAL_DETAIL = ("internal error; it is logged, and retrying will not help until it is fixed: tell the "
                   "operator the time and the URL")


def error_answer(exc) -> tuple[int, dict, dict[str, str]]:
    """Returns (status, body, headers) for an exception that is not bad input: 503 with Retry-After
    when the database is only busy, else 500 (logged with its traceback). For the answers given
    outside DRF (jobs.submit_api's write); exception_handler gives the same."""
    if database_busy(exc):
        logger.warning("database busy: %s", exc)
        return status.HTTP_503_SERVICE_UNAVAILABLE, {"detail": BUSY_DETAIL}, {"Retry-After": str(RETRY_AFTER_S)}
    logger.exception("API error outside DRF", exc_info=exc)
    return status.HTTP_500_INTERNAL_SERVER_ERROR, {"detail": INTERNAL_DETAIL}, {}


def exception_handler(exc, context):
    from jobs.services import IllegalTransition  # the API layer knows the services, not the reverse

    if isinstance(exc, RequestDataTooBig):
        exc = PayloadTooLarge(settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
    if isinstance(exc, DjangoValidationError):
        return Response(_validation_error_data(exc), status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, DjangoPermissionDenied):
        message = str(exc) or "you do not have permission to do this"
        return Response({"detail": message}, status=status.HTTP_403_FORBIDDEN)
    if isinstance(exc, IllegalTransition):
        return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
    if database_busy(exc):
        logger.warning("database busy: %s", exc)
        set_rollback()
        return Response({"detail": BUSY_DETAIL}, status=status.HTTP_503_SERVICE_UNAVAILABLE,
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    response = drf_exception_handler(exc, context)
    if response is None:
        # A bug, not bad input: the client still gets JSON (not Django's HTML page), without the
        # exception's text (it may hold internals); the log has the traceback.
        view = context.get("view")
        logger.exception("API error in %s", type(view).__name__ if view else "?", exc_info=exc)
        set_rollback()
        response = Response({"detail": INTERNAL_DETAIL}, status=status.HTTP_500_INTERNAL_SERVER_ERROR)
    return response
