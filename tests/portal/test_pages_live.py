"""The pages' WebSocket consumer (portal.pages.consumers.LiveConsumer) through Channels'
WebsocketCommunicator and an in-memory channel layer: who may join which group, and
what a push carries to whom. The browser tests (tests/browser/) run the same consumer
behind uvicorn with Redis."""
import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser

from jobs.services import job_transition, preemption_request_create
from portal.pages.routing import websocket_urlpatterns

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def in_memory_layer(settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


def run(coroutine_function):
    return async_to_sync(coroutine_function)()


async def _connect(user):
    communicator = WebsocketCommunicator(URLRouter(websocket_urlpatterns), "/ws/live/")
    communicator.scope["user"] = user
    connected, code = await communicator.connect()
    return communicator, connected, code


async def _subscribe(communicator, groups):
    await communicator.send_json_to({"subscribe": groups})
    return await communicator.receive_json_from(timeout=5)


def test_an_anonymous_socket_is_closed():
    async def scenario():
        # accepted, then closed with the documented code (not an HTTP 403 at the handshake)
        communicator, connected, _ = await _connect(AnonymousUser())
        assert connected
        assert await communicator.receive_output(timeout=5) == {"type": "websocket.close", "code": 4401}

    run(scenario)


def test_a_user_joins_only_groups_they_may_see(alice, carol, team_a, team_b, submit):
    job_a = submit(team_a, alice)
    job_b = submit(team_b, carol)

    async def scenario():
        communicator, connected, _ = await _connect(alice)
        assert connected
        reply = await _subscribe(
            communicator,
            ["fleet", f"team.{team_a.pk}", f"job.{job_a.pk}",
             f"team.{team_b.pk}", f"job.{job_b.pk}", "approvals", "job.x", 7],
        )
        assert reply["type"] == "subscribed"
        assert reply["groups"] == ["fleet", f"team.{team_a.pk}", f"job.{job_a.pk}"]
        assert reply["refused"] == [f"team.{team_b.pk}", f"job.{job_b.pk}", "approvals", "job.x", 7]
        await communicator.disconnect()

        communicator, _, _ = await _connect(carol)
        reply = await _subscribe(communicator, ["approvals", f"job.{job_a.pk}"])
        assert reply["groups"] == ["approvals", f"job.{job_a.pk}"]
        await communicator.disconnect()

    run(scenario)


def test_a_job_change_reaches_its_job_page(alice, team_a, submit):
    job = submit(team_a, alice)

    async def scenario():
        communicator, _, _ = await _connect(alice)
        await _subscribe(communicator, [f"job.{job.pk}"])
        await sync_to_async(job_transition)(job=job, to="cancelled", reason="test")
        message = await communicator.receive_json_from(timeout=5)
        assert message["type"] == "jobs.job_updated"
        assert message["job"]["job_id"] == job.pk and message["job"]["state"] == "cancelled"
        await communicator.disconnect()

    run(scenario)


def test_the_fleet_group_tells_other_teams_only_that_something_changed(alice, charlie, team_a, submit):
    job = submit(team_a, alice)

    async def scenario():
        watcher, _, _ = await _connect(charlie)
        await _subscribe(watcher, ["fleet"])
        # scheduled pushes to the fleet group too (devices were taken)
        await sync_to_async(job_transition)(job=job, to="scheduled", reason="test")
        message = await watcher.receive_json_from(timeout=5)
        assert message == {"type": "fleet.changed"}
        await watcher.disconnect()

    run(scenario)


def test_preemption_requests_reach_capacity_managers(alice, carol, team_a, submit):
    job = submit(team_a, alice)

    async def scenario():
        manager, _, _ = await _connect(carol)
        await _subscribe(manager, ["approvals"])
        await sync_to_async(preemption_request_create)(job=job, reason="needs room", lost_work_seconds=3.0)
        message = await manager.receive_json_from(timeout=5)
        assert message["type"] == "jobs.preemption_updated" and message["preemption"]["job_id"] == job.pk
        await manager.disconnect()

    run(scenario)


def test_an_unknown_fleet_message_does_not_close_the_socket(alice):
    async def scenario():
        from channels.layers import get_channel_layer

        communicator, _, _ = await _connect(alice)
        await _subscribe(communicator, ["fleet"])
        await get_channel_layer().group_send("fleet", {"type": "fleet.node_updated", "node_id": 3})
        assert await communicator.receive_json_from(timeout=5) == {"type": "fleet.changed"}
        await get_channel_layer().group_send("fleet", {"type": "mystery.thing"})
        await communicator.send_json_to({"subscribe": ["fleet"]})
        assert (await communicator.receive_json_from(timeout=5))["type"] == "subscribed"
        await communicator.disconnect()

    run(scenario)
