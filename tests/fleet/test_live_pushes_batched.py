"""fleet.live.pushes_batched: the page pushes of the transactions that commit inside it go out when it
ends, all of them, in their order, in one hop to the event loop; a rolled-back change pushes nothing;
a nested block leaves the sending to the outermost one."""
import asyncio

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

from fleet import live
from fleet.live import events_publish, pushes_batched

pytestmark = pytest.mark.django_db(transaction=True)  # real commits: their on-commit callbacks run


@pytest.fixture
def group(settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)("fleet", channel)

    async def drain():
        messages = []
        while True:
            try:
                messages.append(await asyncio.wait_for(layer.receive(channel), 0.2))
            except asyncio.TimeoutError:
                return messages

    return lambda: [m["n"] for m in async_to_sync(drain)()]


def push(n):
    events_publish(groups=["fleet"], type="fleet.node_updated", payload={"n": n})


def test_the_pushes_of_committed_transactions_go_out_when_it_ends_in_order(group, monkeypatch):
    hops = []
    real = live._groups_send

    async def counted(layer, pushes):
        hops.append(len(pushes))
        return await real(layer, pushes)

    monkeypatch.setattr(live, "_groups_send", counted)
    with pushes_batched():
        with transaction.atomic():
            push(1)
            push(2)
        with pytest.raises(RuntimeError), transaction.atomic():
            push(3)
            raise RuntimeError("rolled back")
        with pushes_batched(), transaction.atomic():  # nested: the outer one sends
            push(4)
        assert group() == []  # held until the block ends
    assert group() == [1, 2, 4]
    assert hops == [3]


def test_without_it_each_push_goes_at_its_commit(group):
    with transaction.atomic():
        push(1)
    assert group() == [1]
