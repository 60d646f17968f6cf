"""WebSocket URL patterns served by portal.asgi. The dashboard's consumers (issue 6)
live in portal.pages.routing.websocket_urlpatterns and are mounted when it exists."""
from importlib import import_module
from importlib.util import find_spec

websocket_urlpatterns = []

if find_spec("portal.pages") and find_spec("portal.pages.routing"):
    websocket_urlpatterns += import_module("portal.pages.routing").websocket_urlpatterns
