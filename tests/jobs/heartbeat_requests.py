"""One POST /api/agent/heartbeat/ through the real ASGI application (portal.asgi), for the tests of the
paths answered before Django (tests/jobs/test_heartbeat_fast_path.py, test_heartbeat_on_loop.py)."""
import json

from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator
from django.conf import settings as django_settings
from django.core.signals import request_started

from jobs.heartbeat_api import HEARTBEAT_PATH


def post(body, *, token, fast=True, raw=None, headers=()):
    """Returns (status, headers without Content-Length, the JSON body, whether Django answered) of
    one heartbeat with MERIDIAN_HEARTBEAT_FAST_PATH `fast`; Django's answering is seen from its
    request_started signal."""
    from portal.asgi import application

    payload = raw if raw is not None else json.dumps(body).encode()
    sent = [(b"host", b"testserver"), (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            *([(b"authorization", f"Node {token}".encode())] if token else []), *headers]
    django_answered = []

    def seen(**_):
        django_answered.append(True)

    request_started.connect(seen, weak=False)
    old = django_settings.MERIDIAN_HEARTBEAT_FAST_PATH
    django_settings.MERIDIAN_HEARTBEAT_FAST_PATH = fast
    try:
        communicator = HttpCommunicator(application, "POST", HEARTBEAT_PATH, body=payload, headers=sent)
        response = async_to_sync(communicator.get_response)(timeout=20)
    finally:
        django_settings.MERIDIAN_HEARTBEAT_FAST_PATH = old
        request_started.disconnect(seen)
    answer_headers = sorted((name.lower(), value) for name, value in response["headers"]
                            if name.lower() != b"content-length")
    return response["status"], answer_headers, json.loads(response["body"]), bool(django_answered)
