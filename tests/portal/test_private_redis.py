"""The embedded path: a private redis-server on a unix socket carries the Channels layer
and the Celery broker; live pushes leave only after the transaction commits."""
import asyncio
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from channels_redis.core import RedisChannelLayer
from kombu import Connection

from fleet.live import events_publish, events_publish_now
from portal.private_redis import PrivateRedis, PrivateRedisError
from portal.settings import celery_url_from_redis_url


def in_own_thread(function, *args):
    """Returns function(*args) run in a fresh thread: async_to_sync refuses a thread whose
    event loop is running, and an earlier test (a session-scoped Playwright, say) may
    leave one running in the main thread."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(function, *args).result(timeout=60)


@pytest.fixture
def private_redis():
    directory = tempfile.mkdtemp(prefix="mr-")
    with PrivateRedis(Path(directory) / "redis.sock") as redis:
        yield redis
    shutil.rmtree(directory, ignore_errors=True)


async def _round_trip(layer):
    channel = await layer.new_channel()
    await layer.group_add("fleet", channel)
    await layer.group_send("fleet", {"type": "fleet.node_updated", "node_id": 7})
    message = await layer.receive(channel)
    await layer.group_discard("fleet", channel)
    return message


def test_the_private_redis_listens_only_on_its_socket_and_carries_channels(private_redis):
    layer = RedisChannelLayer(hosts=[private_redis.url], prefix="meridian-test")

    assert in_own_thread(asyncio.run, _round_trip(layer)) == {"type": "fleet.node_updated", "node_id": 7}
    assert private_redis.socket_path.is_socket()


def test_the_private_redis_carries_celery_messages(private_redis):
    with Connection(celery_url_from_redis_url(private_redis.url)) as connection:
        queue = connection.SimpleQueue("meridian-test")
        queue.put({"job_id": 3})
        message = queue.get(timeout=10)
        message.ack()
        queue.close()

    assert message.payload == {"job_id": 3}


def test_a_second_private_redis_on_the_same_socket_is_refused(private_redis):
    with pytest.raises(PrivateRedisError, match="already listens"):
        PrivateRedis(private_redis.socket_path).start()


def test_a_too_long_socket_path_is_refused_with_advice():
    with pytest.raises(PrivateRedisError, match="set MERIDIAN_DATA_DIR to a shorter directory"):
        PrivateRedis("/tmp/" + "x" * 120 + "/redis.sock")


def test_the_configured_layer_delivers_job_updates_after_commit(
    redis_url, settings, team_a, alice, submit, django_capture_on_commit_callbacks
):
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [redis_url], "prefix": "meridian-test"},
        }
    }
    layer = get_channel_layer()
    channel = in_own_thread(async_to_sync(layer.new_channel))
    in_own_thread(async_to_sync(layer.group_add), "team." + str(team_a.pk), channel)

    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        job = submit(team_a, alice)
    assert callbacks, "the push must wait for the commit"
    for callback in callbacks:
        in_own_thread(callback)

    message = in_own_thread(async_to_sync(layer.receive), channel)
    assert (message["type"], message["job"]["job_id"], message["job"]["state"]) == (
        "jobs.job_updated", job.pk, "pending"
    )


def test_publishing_without_a_reachable_layer_never_breaks_the_write(settings, db):
    settings.CHANNEL_LAYERS = {
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": ["unix:///nonexistent/redis.sock"]}}
    }

    # outside a transaction: sends now
    events_publish(groups=["fleet"], type="fleet.node_updated", payload={"node_id": 1})

    assert events_publish_now(groups=["fleet"], message={"type": "fleet.node_updated"}) == 0


def test_a_message_type_needs_an_app_prefix():
    with pytest.raises(ValueError, match="needs an app prefix"):
        events_publish(groups=["fleet"], type="job_updated", payload={})
