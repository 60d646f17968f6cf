"""GET /metrics: Prometheus' text exposition of observability.metrics, summed over every web
process and Celery worker of this host (prometheus_client's multiprocess collector reads the
files under PROMETHEUS_MULTIPROC_DIR; no database query per scrape).

Access: `Authorization: Bearer <operator token>` (settings.MERIDIAN_METRICS_TOKEN, from the
environment or a file, never a command line). A user's session or API token does not open it:
401 without the header, 403 with a wrong token or when no operator token is configured.
"""
import hmac

from django.conf import settings
from django.http import HttpResponse
from django.urls import reverse
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess

from observability.metrics import heartbeat_observed


def _refused(status, detail, **headers):
    response = HttpResponse(f'{{"detail": "{detail}"}}', status=status, content_type="application/json")
    for name, value in headers.items():
        response[name] = value
    return response


@require_GET
def metrics_view(request):
    expected = settings.MERIDIAN_METRICS_TOKEN
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return _refused(401, "send Authorization: Bearer <operator metrics token> (MERIDIAN_METRICS_TOKEN)",
                        **{"WWW-Authenticate": 'Bearer realm="metrics"'})
    if not expected:
        return _refused(403, "metrics are off: no operator token is configured (set MERIDIAN_METRICS_TOKEN "
                             "or MERIDIAN_METRICS_TOKEN_FILE)")
    if not hmac.compare_digest(token.strip().encode(), expected.encode()):
        return _refused(403, "wrong metrics token")
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)


class HeartbeatMetricsMiddleware:
    """Counts every request to the agent heartbeat API that Django answers and the refused ones (by
    status): the answer is what the agent got, whichever layer (authentication, validation, the
    view) gave it. The heartbeats answered before Django count themselves (jobs/heartbeat_api.py)."""

    def __init__(self, get_response):
        self.get_response = get_response
        self.path = None

    def __call__(self, request):
        response = self.get_response(request)
        if self.path is None:
            self.path = reverse("api-agent-heartbeat")
        if request.path == self.path:
            heartbeat_observed(status=response.status_code)
        return response
