"""WebSocket URL patterns served by portal.asgi: the dashboard's consumers (portal.pages)."""
from portal.pages.routing import websocket_urlpatterns

__all__ = ["websocket_urlpatterns"]
