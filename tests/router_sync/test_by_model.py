"""Two deployments of different models behind one real vllm-router, started the way `motorctl up`
starts it, kept by RouterSync: each model's requests reach only that model's engines."""

from __future__ import annotations

import asyncio
import json

import pytest

from motor.v1 import controller_pb2
from tests.support.engine_server_process import engine_server, sim_config  # noqa: F401 (fixtures)
from tests.support.model_routing import Running, answers, chat_and_embed, model_router, served, snapshot, until  # noqa: F401 (fixtures)
from tests.support.open_load import http

pytestmark = pytest.mark.processes  # the real vllm-router and engine servers


async def test_each_models_requests_reach_only_its_engines(model_router, chat_and_embed):
    engines = chat_and_embed
    async with Running(model_router.url, by_model=True) as running:
        running.sync.apply(
            snapshot(
                served(engines["chat-0"], "chat", "sim-chat"),
                # an adapter loaded into chat-1: filed under its own name at its own worker URL
                served(engines["chat-1"], "chat", "sim-chat", "chat-lora"),
                served(engines["embed-0"], "embed", "sim-embed"),
            )
        )
        await until(lambda: len(model_router.workers()) == 4, what="three engines and an adapter added")
        assert await asyncio.to_thread(answers, model_router.url, "sim-chat") == [(200, "sim-chat")] * 12
        assert await asyncio.to_thread(answers, model_router.url, "sim-embed") == [(200, "sim-embed")] * 12
        status, text = http("GET", model_router.url + "/workers")
        assert status == 200, text
        by_url = {w["url"]: w["model_id"] for w in json.loads(text)["workers"]}
        assert by_url == {
            f"http://127.0.0.1:{engines[i].port}": m
            for i, m in (("chat-0", "sim-chat"), ("chat-1", "sim-chat"), ("embed-0", "sim-embed"))
        } | {f"http://chat-lora@127.0.0.1:{engines['chat-1'].port}": "chat-lora"}
        assert running.events == []


async def test_an_unknown_model_gets_404_and_a_model_left_without_engines_reaches_no_other(
    model_router, chat_and_embed
):
    engines = chat_and_embed
    async with Running(model_router.url, by_model=True) as running:
        chat = [served(engines[i], "chat", "sim-chat") for i in ("chat-0", "chat-1")]
        embed = served(engines["embed-0"], "embed", "sim-embed")
        running.sync.apply(snapshot(*chat, embed))
        await until(lambda: len(model_router.workers()) == 3, what="three engines added")
        # vllm-router 0.1.17 alone has no 404 of its own: it sends a request for a model it has no
        # worker of to some worker, whose engine answers vLLM's 404 (docs/router.md); the front
        # door answers it itself (test_front_door.py).
        assert {a for a in await asyncio.to_thread(answers, model_router.url, "no-such-model")} == {
            (404, "NotFoundError")
        }
        running.sync.apply(controller_pb2.WatchEndpointsResponse(removed=[embed]))  # deployment embed deleted
        await until(lambda: len(model_router.workers()) == 2, what="the embed engine removed")
        assert {a for a in await asyncio.to_thread(answers, model_router.url, "sim-embed")} == {(404, "NotFoundError")}
        assert await asyncio.to_thread(answers, model_router.url, "sim-chat") == [(200, "sim-chat")] * 12


def filed_models(router) -> dict[str, str]:
    status, text = http("GET", router.url + "/workers")
    assert status == 200, text
    return {w["url"]: w["model_id"] for w in json.loads(text)["workers"]}


async def test_a_url_taken_over_by_an_engine_of_another_model_is_filed_again_under_it(model_router, chat_and_embed):
    engines = chat_and_embed
    async with Running(model_router.url, by_model=True) as running:
        before = served(engines["embed-0"], "embed", "sim-embed")
        running.sync.apply(snapshot(before))
        url = before.url
        await until(lambda: filed_models(model_router) == {url: "sim-embed"}, what="the engine filed under sim-embed")
        # deployment embed deleted and, before the sync's next pass, its port given to another's engine
        after = served(engines["embed-0"], "rerank", "sim-rerank")
        running.sync.apply(controller_pb2.WatchEndpointsResponse(removed=[before], added=[after]))
        await until(lambda: filed_models(model_router) == {url: "sim-rerank"}, what="the URL filed under sim-rerank")


async def test_what_a_client_gets_without_a_model_and_from_models_list(model_router, chat_and_embed):
    """docs/router.md's multi-model notes, as measured: /v1/models is the router's own shape, which
    an OpenAI client's models.list() reads as an empty list (no error), what Motor's front door
    answers in its place. (A request without `model` the router sometimes serves from some worker
    and sometimes refuses 503 "No available workers": the front door never passes one on.)"""
    import openai

    engines = chat_and_embed
    async with Running(model_router.url, by_model=True) as running:
        running.sync.apply(
            snapshot(
                *(served(engines[i], "chat", "sim-chat") for i in ("chat-0", "chat-1")),
                served(engines["embed-0"], "embed", "sim-embed"),
            )  # fmt: skip
        )
        await until(lambda: len(model_router.workers()) == 3, what="three engines added")
        status, text = http("GET", model_router.url + "/v1/models")
        assert status == 200 and sorted(json.loads(text)["models"]) == ["sim-chat", "sim-embed"], text
        client = openai.OpenAI(base_url=model_router.url + "/v1", api_key="none")
        listed = await asyncio.to_thread(lambda: list(client.models.list()))
        assert listed == []
