"""ASGI entry point (served by uvicorn: portal/web_server.py): HTTP through Django, WebSockets
through Channels; the agents' liveness lease (POST /api/agent/lease/) before Django (fleet.lease_api.LeaseRouter), and
submissions by API token (POST /api/jobs/) and the agents' full heartbeats (POST
/api/agent/heartbeat/) before Django when they certainly can be (jobs.submit_api.FastPathRouter, made by
SubmitRouter and
jobs.heartbeat_api.HeartbeatRouter).

WebSocket routes are `portal.routing.websocket_urlpatterns` (the pages' consumers).
"""
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
django_asgi_app = get_asgi_application()

from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

if settings.MERIDIAN_SERVE_STATIC:
    # the web server serves no static files itself; at scale put a CDN or nginx in front and
    # set MERIDIAN_SERVE_STATIC=0.
    django_asgi_app = ASGIStaticFilesHandler(django_asgi_app)

# The agents' liveness lease is answered before Django (fleet/lease_api.py): ~a Redis write.
from fleet.lease_api import LeaseRouter  # noqa: E402

django_asgi_app = LeaseRouter(django_asgi_app)

# POST /api/jobs/ is answered before Django when it certainly can be (jobs/submit_api.py); the rest
# of it, and everything else, goes through Django.
from jobs.submit_api import SubmitRouter  # noqa: E402


def _error_answer(exc):
    # Imported late: DRF's settings import portal.api_errors while rest_framework.views loads, so
    # importing it first here would import it half-made.
    from portal.api_errors import error_answer

    return error_answer(exc)


django_asgi_app = SubmitRouter(django_asgi_app, error_answer=_error_answer)

# POST /api/agent/heartbeat/ likewise (jobs/heartbeat_api.py): a node's full heartbeat with its own
# token and a well-formed body, without Django's middleware and DRF.
from jobs.heartbeat_api import HeartbeatRouter  # noqa: E402

django_asgi_app = HeartbeatRouter(django_asgi_app, error_answer=_error_answer)

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs Django set up)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from portal.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
        ),
    }
)
