"""WebSocket routes of the pages, mounted by portal.routing (portal.asgi)."""
from django.urls import path

from portal.pages.consumers import LiveConsumer

websocket_urlpatterns = [
    path("ws/live/", LiveConsumer.as_asgi()),
]
