"""The front door (front_door/policy.py) in front of the real vllm-router, both kept by the sync, as
`motorctl up` and compose run them: two models and a LoRA adapter behind one address, OpenAI's model
list, vLLM's 404 naming the served models, a request without `model`, streams chunk by chunk."""

from __future__ import annotations

import asyncio
import gzip
import json
import time

import aiohttp
import pytest
from aiohttp import web

from front_door.policy import FrontDoor
from motor.ports import free_port
from motor.v1 import controller_pb2
from tests.support import serve_app
from tests.support.engine_server_process import engine_server, sim_config  # noqa: F401 (fixtures)
from tests.support.model_routing import Running, chat_and_embed, model_router, served, snapshot, until  # noqa: F401 (fixtures)

pytestmark = pytest.mark.processes  # the real vllm-router and engine servers


class Door:
    """A sync and its front door in this process, in front of `router`."""

    def __init__(self, router_url: str):
        self.running = Running(router_url, by_model=True)
        self.front = FrontDoor(router_url, self.running.sync.served, self.running.sync.knows_served)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.session = aiohttp.ClientSession()

    async def start(self) -> Door:
        await self.front.start("127.0.0.1", self.port)
        return self

    async def close(self) -> None:
        await self.session.close()
        await self.front.close()
        await self.running.close()

    def apply(self, message) -> None:
        self.running.sync.apply(message)

    async def request(self, method: str, path: str, body=None) -> tuple[int, dict]:
        async with self.session.request(method, self.url + path, json=body) as reply:
            return reply.status, json.loads(await reply.read() or b"null")

    async def answers(self, model: str | None, count: int = 12) -> list[tuple[int, str]]:
        """(status, the model that answered or the error type) of `count` completions."""
        result = []
        for _ in range(count):
            body = {"prompt": "hi", "max_tokens": 2} | ({"model": model} if model is not None else {})
            status, answer = await self.request("POST", "/v1/completions", body)
            result.append((status, answer["model"] if status == 200 else answer["error"]["type"]))
        return result

    async def served_now(self) -> set[str]:
        return {m["id"] for m in (await self.request("GET", "/v1/models"))[1]["data"]}


@pytest.fixture
async def door(model_router):  # noqa: F811
    started = await Door(model_router.url).start()
    yield started
    await started.close()


async def load_adapter(engine, name: str, folder) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    async with aiohttp.ClientSession() as session:
        body = {"lora_name": name, "lora_path": str(folder)}
        async with session.post(f"http://127.0.0.1:{engine.port}/v1/load_lora_adapter", json=body) as reply:
            assert reply.status == 200, await reply.text()


async def test_two_models_and_an_adapter_behind_one_address(door, chat_and_embed, tmp_path):  # noqa: F811
    engines = chat_and_embed
    await load_adapter(engines["chat-1"], "sql", tmp_path / "sql")
    chat_1 = served(engines["chat-1"], "chat", "sim-chat", "sql")  # the adapter loaded into chat-1 only
    embed = served(engines["embed-0"], "embed", "sim-embed")
    door.apply(snapshot(served(engines["chat-0"], "chat", "sim-chat"), chat_1, embed))
    await until(lambda: len(door.running.sync.served()) == 3, what="both models and the adapter in the router")

    # each model's requests reach only its engines (another model's engine would answer 404)
    assert await door.answers("sim-chat") == [(200, "sim-chat")] * 12
    assert await door.answers("sim-embed") == [(200, "sim-embed")] * 12
    # the adapter reaches only the engine that has it (chat-0 would answer 404)
    assert await door.answers("sql") == [(200, "sql")] * 12

    status, listed = await door.request("GET", "/v1/models")
    assert status == 200 and listed["object"] == "list"
    assert [(m["id"], m["object"], m["parent"]) for m in listed["data"]] == [
        ("sim-chat", "model", None),
        ("sim-embed", "model", None),
        ("sql", "model", "sim-chat"),
    ]

    status, answer = await door.request("POST", "/v1/completions", {"model": "gpt-x", "prompt": "hi"})
    assert status == 404 and answer["error"]["type"] == "NotFoundError"
    assert answer["error"]["message"] == "The model `gpt-x` does not exist. Valid aliases: sim-chat, sim-embed, sql."

    status, answer = await door.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 400 and answer["error"]["type"] == "BadRequestError"
    assert "sim-chat, sim-embed, sql" in answer["error"]["message"] and "`model`" in answer["error"]["message"]

    # the adapter unloaded (the controller lists the engine again without it): a 404 naming what is served
    door.apply(
        controller_pb2.WatchEndpointsResponse(removed=[chat_1], added=[served(engines["chat-1"], "chat", "sim-chat")])
    )
    assert await door.answers("sql", count=3) == [(404, "NotFoundError")] * 3
    assert await door.served_now() == {"sim-chat", "sim-embed"}
    await until(lambda: not any("@" in url for url in door.running.sync.known), what="the adapter's worker removed")

    # the embed deployment deleted: its requests get the 404, never another model's engine; and a
    # request without `model` is now served by the one model left
    door.apply(controller_pb2.WatchEndpointsResponse(removed=[embed]))
    assert await door.answers("sim-embed", count=3) == [(404, "NotFoundError")] * 3
    assert await door.answers(None) == [(200, "sim-chat")] * 12
    assert door.running.events == []


async def test_an_adapters_last_engine_leaving_gives_the_404(door, chat_and_embed, tmp_path):  # noqa: F811
    engines = chat_and_embed
    await load_adapter(engines["chat-1"], "sql", tmp_path / "sql")
    chat_1 = served(engines["chat-1"], "chat", "sim-chat", "sql")
    door.apply(snapshot(served(engines["chat-0"], "chat", "sim-chat"), chat_1))
    await until(lambda: "sql" in door.running.sync.served(), what="the adapter in the router")
    assert await door.answers("sql", count=4) == [(200, "sql")] * 4
    door.apply(controller_pb2.WatchEndpointsResponse(removed=[chat_1]))  # chat-1 withdrawn (hung, drained, gone)
    assert await door.answers("sql", count=4) == [(404, "NotFoundError")] * 4
    assert await door.answers("sim-chat") == [(200, "sim-chat")] * 12


async def test_a_starting_front_door_answers_503_until_its_sync_knows_the_models(door, chat_and_embed):  # noqa: F811
    """A sync just (re)started knows no model until Motor's first list and its first read of the
    router: a request meanwhile is refused as unavailable (to retry), never told that its model
    does not exist."""
    assert await door.answers("sim-chat", count=3) == [(503, "ServiceUnavailableError")] * 3
    door.apply(snapshot(served(chat_and_embed["chat-0"], "chat", "sim-chat")))
    await until(lambda: "sim-chat" in door.running.sync.served(), what="the model in the router")
    assert await door.answers("sim-chat", count=3) == [(200, "sim-chat")] * 3
    assert await door.answers("sim-other", count=1) == [(404, "NotFoundError")]


async def test_admin_calls_are_refused_and_the_door_counts_requests(door, chat_and_embed):  # noqa: F811
    door.apply(snapshot(served(chat_and_embed["chat-0"], "chat", "sim-chat")))
    await until(lambda: "sim-chat" in door.running.sync.served(), what="sim-chat in the router")
    status, answer = await door.request("POST", "/add_worker?url=http://127.0.0.1:1")
    assert status == 403 and "Motor keeps its workers" in answer["error"]["message"]
    assert await door.answers("sim-chat", count=2) == [(200, "sim-chat")] * 2
    async with door.session.get(door.url + "/metrics") as reply:
        text = await reply.text()
    assert 'motor_front_door_requests_total{code="200",model="sim-chat"} 2.0' in text
    assert 'motor_front_door_requests_total{code="403",model=""} 1.0' in text
    status, workers = await door.request("GET", "/list_workers")  # reading the router's list passes
    assert status == 200 and len(workers["urls"]) == 1


@pytest.fixture
async def slow_stream():
    """A server that sends one server-sent event every 0.2 s: to see when each reaches the client."""

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(5):
            await response.write(f"data: {index}\n\n".encode())
            await asyncio.sleep(0.2)
        await response.write(b"data: [DONE]\n\n")
        return response

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    app.router.add_get("/health", health)
    runner, url = await serve_app(app)
    yield url
    await runner.cleanup()


async def test_a_stream_passes_through_event_by_event(door, slow_stream):
    door.apply(
        snapshot(controller_pb2.Endpoint(instance_id="s-0", engine_id="s-0/rank0", url=slow_stream, models=["slow"]))
    )
    await until(lambda: "slow" in door.running.sync.served(), what="the streaming server in the router")
    began, arrivals = time.monotonic(), []
    async with door.session.post(
        door.url + "/v1/completions", json={"model": "slow", "prompt": "hi", "stream": True}
    ) as reply:
        assert reply.status == 200
        async for line in reply.content:
            if line.startswith(b"data: "):
                arrivals.append((line.strip(), time.monotonic() - began))
    assert [a[0] for a in arrivals] == [b"data: 0", b"data: 1", b"data: 2", b"data: 3", b"data: 4", b"data: [DONE]"]
    # the first event arrives long before the last was sent (1 s later): nothing is held back
    assert arrivals[0][1] < arrivals[-1][1] - 0.5


async def test_a_compressed_request_is_served_and_leaves_its_model_served(door, chat_and_embed):  # noqa: F811
    """A client that gzips its request body: the front door reads it decoded (to see the model) and
    must send it on as what it is. Sent on still marked gzip, the engine failed it with 500, the
    router retried it onto the model's engine until its circuit opened, and every request for the
    model got 503 for the next 30 s: one request took a model down."""
    door.apply(snapshot(served(chat_and_embed["chat-0"], "chat", "sim-chat")))
    await until(lambda: "sim-chat" in door.running.sync.served(), what="sim-chat in the router")
    body = gzip.compress(json.dumps({"model": "sim-chat", "prompt": "hi", "max_tokens": 2}).encode())
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    async with door.session.post(door.url + "/v1/completions", data=body, headers=headers) as reply:
        assert reply.status == 200, await reply.text()
        assert (await reply.json())["model"] == "sim-chat"
    assert await door.answers("sim-chat", count=6) == [(200, "sim-chat")] * 6


async def test_the_routers_cache_flush_is_refused_on_the_published_port(door, chat_and_embed):  # noqa: F811
    """vllm-router's `POST /flush_cache` sends a cache flush to every engine it has (SGLang's
    engines drop their whole prefix cache): an admin call, not a client's."""
    door.apply(snapshot(served(chat_and_embed["chat-0"], "chat", "sim-chat")))
    await until(lambda: "sim-chat" in door.running.sync.served(), what="sim-chat in the router")
    status, answer = await door.request("POST", "/flush_cache")
    assert status == 403 and answer["error"]["type"] == "PermissionDeniedError"


async def test_a_client_leaving_mid_stream_is_no_router_error(door, chat_and_embed):  # noqa: F811
    """A chat user who stops a generation closes the stream: the router answered, the client went.
    Counting it as the router's failure (and as a 502 never sent) would page on every stop button."""
    door.apply(snapshot(served(chat_and_embed["chat-0"], "chat", "sim-chat")))
    await until(lambda: "sim-chat" in door.running.sync.served(), what="sim-chat in the router")
    for _ in range(30):
        reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
        body = json.dumps({"model": "sim-chat", "prompt": "hi", "max_tokens": 5000, "stream": True}).encode()
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: door\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert b"data: " in await reader.readuntil(b"data: ")
        await reader.read(2000)
        writer.transport.abort()  # gone mid-stream, most of the tokens unread
    await asyncio.sleep(1.0)
    async with door.session.get(door.url + "/metrics") as reply:
        text = await reply.text()
    assert "motor_front_door_router_errors_total 0.0" in text
    assert 'code="502"' not in text
    assert "motor_front_door_requests_in_flight 0.0" in text


@pytest.fixture
async def two_named_servers():
    """Two servers that answer any POST with their own name: which one a request reached."""
    runners, urls = [], {}
    for name in ("model-a", "model-b"):

        async def answer(request: web.Request, name=name) -> web.Response:
            return web.json_response({"served_by": name})

        async def health(request: web.Request) -> web.Response:
            return web.json_response({})

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/{tail:.*}", answer)
        runner, urls[name] = await serve_app(app)
        runners.append(runner)
    yield urls
    for runner in runners:
        await runner.cleanup()


# vLLM's other APIs that name the model in a JSON body: Anthropic's Messages, SageMaker's, Cohere's,
# the render and batch endpoints.
OTHER_MODEL_APIS = [
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/invocations",
    "/v1/chat/completions/render",
    "/v2/embed",
]


async def test_vllms_other_model_apis_get_the_404_for_an_unknown_model(door, two_named_servers):
    """The router sends a request whose model has no worker to any worker: another model's engine
    would answer it (its own 404 naming its own model). The door must check every API that names
    a model, not only the OpenAI ones."""
    door.apply(
        snapshot(
            *(
                controller_pb2.Endpoint(instance_id=f"{name}-0", engine_id=f"{name}-0/rank0", url=url, models=[name])
                for name, url in two_named_servers.items()
            )
        )
    )
    await until(lambda: len(door.running.sync.served()) == 2, what="both servers in the router")
    chat = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    for path in OTHER_MODEL_APIS:
        status, answer = await door.request("POST", path, {"model": "gpt-x", **chat})
        assert status == 404, (path, answer)
        assert answer["error"]["message"] == "The model `gpt-x` does not exist. Valid aliases: model-a, model-b."
    # (A served model's request on these paths is the router's to route: vllm-router 0.1.17 sends
    # them by model in some of its starts and to its empty P/D router, 503, in others.)


async def test_a_starting_front_door_lists_no_models_as_unknown_not_as_none(door, chat_and_embed):  # noqa: F811
    """vLLM's own examples pick `client.models.list().data[0].id`: an empty list from a door that
    does not know yet what is served would crash them, and tell a readiness probe "no model"."""
    status, answer = await door.request("GET", "/v1/models")
    assert status == 503 and answer["error"]["type"] == "ServiceUnavailableError"
    door.apply(snapshot(served(chat_and_embed["chat-0"], "chat", "sim-chat")))
    await until(lambda: "sim-chat" in door.running.sync.served(), what="the model in the router")
    assert await door.served_now() == {"sim-chat"}
