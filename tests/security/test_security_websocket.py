"""Low findings (issue 15) on the pages' WebSocket (portal.pages.consumers.LiveConsumer): a frame
that is not JSON text, or a group name like "job.²", never crashes the socket (it was closed with
1011); an anonymous socket gets the documented close code 4401 (it was an HTTP 403)."""
import pytest
from asgiref.sync import async_to_sync
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser

from portal.pages.consumers import CLOSE_BAD_FRAME, CLOSE_UNAUTHENTICATED
from portal.pages.routing import websocket_urlpatterns

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def in_memory_layer(settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


async def _connected(user):
    communicator = WebsocketCommunicator(URLRouter(websocket_urlpatterns), "/ws/live/")
    communicator.scope["user"] = user
    connected, _ = await communicator.connect()
    assert connected
    return communicator


@pytest.mark.parametrize("frame", [{"text_data": "not json"}, {"text_data": "[" * 5000},
                                   {"bytes_data": b"\x00\xff binary"}], ids=["text", "deep", "binary"])
def test_a_frame_that_is_not_json_text_closes_with_the_documented_code(alice, frame):
    async def scenario():
        communicator = await _connected(alice)
        await communicator.send_to(**frame)
        error = await communicator.receive_json_from(timeout=5)
        closed = await communicator.receive_output(timeout=5)
        assert error["type"] == "error" and "subscribe" in error["error"]
        assert closed == {"type": "websocket.close", "code": CLOSE_BAD_FRAME}

    async_to_sync(scenario)()


@pytest.mark.parametrize("group", ["job.²", "team.²", "job.99999999999999999999999", "job.-1", "job.", ""])
def test_odd_group_names_are_refused_and_the_socket_lives_on(alice, team_a, group):
    async def scenario():
        communicator = await _connected(alice)
        await communicator.send_json_to({"subscribe": [group, f"team.{team_a.pk}"]})
        reply = await communicator.receive_json_from(timeout=5)
        assert reply == {"type": "subscribed", "groups": [f"team.{team_a.pk}"], "refused": [group]}
        await communicator.disconnect()

    async_to_sync(scenario)()


def test_an_anonymous_socket_is_accepted_then_closed_with_4401():
    async def scenario():
        communicator = await _connected(AnonymousUser())
        assert await communicator.receive_output(timeout=5) == {"type": "websocket.close",
                                                                 "code": CLOSE_UNAUTHENTICATED}

    async_to_sync(scenario)()
