"""WebSocket URL patterns. Pages add their consumers here, e.g.
`websocket_urlpatterns += pages_routing.websocket_urlpatterns`."""
websocket_urlpatterns = []
