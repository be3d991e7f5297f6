"""WatchEndpoints says which models Motor serves even while no engine of one can serve it
(`models_added`, `models_removed`): a front door then answers 503, to retry, not 404 "does not
exist"."""

from __future__ import annotations

import asyncio

from controller.routing import endpoints
from motor.v1 import controller_pb2 as C
from tests.support.controller_harness import small_deployment


def chat():
    deployment = small_deployment([{"name": "chat", "role": "union", "count": 1}], name="chat", model="sim-chat")
    deployment.adapters.add(name="chat-lora", path="adapters/chat-lora")
    return deployment


def embed():
    return small_deployment([{"name": "embed", "role": "union", "count": 1}], name="embed", model="sim-embed")


async def next_models(feed) -> tuple[list[str], list[str]]:
    """The next change of the models served, skipping changes of engines only."""
    while True:
        change = await asyncio.wait_for(anext(feed), 5)
        if change.models_added or change.models_removed:
            return list(change.models_added), list(change.models_removed)


async def test_the_snapshot_and_each_apply_or_delete_carry_the_models_served_before_any_engine_serves(harness):
    ctl = await harness.start()
    ctl.apply_deployment(chat())
    feed = ctl.endpoints.subscribe()
    snapshot = await asyncio.wait_for(anext(feed), 5)
    assert snapshot.snapshot and list(snapshot.added) == []  # no engine serves yet; the model is Motor's
    assert list(snapshot.models_added) == ["chat-lora", "sim-chat"]
    ctl.apply_deployment(embed())
    assert await next_models(feed) == (["sim-embed"], [])
    ctl.delete_deployment("chat")
    assert await next_models(feed) == ([], ["chat-lora", "sim-chat"])
    feed.close()


def test_a_watcher_filtered_by_model_hears_of_that_model_only():
    change = C.WatchEndpointsResponse(models_added=["sim-a"], models_removed=["sim-b"])
    assert endpoints.of_role(change, 0, "sim-c") is None
    kept = endpoints.of_role(change, 0, "sim-a")
    assert list(kept.models_added) == ["sim-a"] and list(kept.models_removed) == []
    assert list(endpoints.of_role(change, 0, "").models_removed) == ["sim-b"]
