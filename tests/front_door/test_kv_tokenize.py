"""A real engine's text prompt routed by KV cache: its token ids asked of an engine's /tokenize
(front_door/kv_tokenize.py) with the engine key, then the engine holding its prefix chosen; a
tokenizer that fails or is slow leaves the request to the router, as before."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from prometheus_client import CollectorRegistry

from front_door.kv_prompt import json_object
from front_door.kv_routing import KvRouting
from front_door.kv_tokenize import tokenize_request
from front_door.messages import Forward, Request
from motor.contract.kv_events import BlockStored, EventBatch
from tests.support import serve_app
from tests.support.keyed_door import KEYS, StandIn, exchange, keyed_door, post

CHANGED = b'{"model": "tiny", "prompt": "x"}'  # the body as the door's stages left it
SYSTEM = "You are a careful assistant. " * 20


def ids_of(text: str) -> list[int]:
    """The stand-in engine's tokenizer: one id per character (anything the door cannot guess)."""
    return [1] + [ord(c) % 5000 + 7 for c in text]


class Engine:
    def __init__(self, status: int = 200, delay: float = 0.0) -> None:
        self.asked: list[tuple[dict, str]] = []
        self.status, self.delay = status, delay

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.asked.append((body, request.headers.get("Authorization", "")))
        await asyncio.sleep(self.delay)
        if self.status != 200:
            return web.json_response({"error": "no"}, status=self.status)
        text = body.get("prompt") or "".join(f"<{m['role']}>{m['content']}" for m in body["messages"])
        return web.json_response({"count": len(ids_of(text)), "tokens": ids_of(text)})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/tokenize", self.tokenize)
        return app


def request_for(body: dict) -> Request:
    request = Request("POST", b"/v1/completions", "/v1/completions", [], b"", keep_alive=True, http_10=False)
    request.body = json.dumps(body).encode()
    request.label = "tiny"
    return request


async def routing(urls: list[str]) -> KvRouting:
    kv = KvRouting(lambda: {"tiny": None}, CollectorRegistry())
    engines = [
        {"engine_id": f"e{n}", "generation": 1, "url": url, "models": ["tiny"], "tokenizer": "/models/tiny"}
        for n, url in enumerate(urls)
    ]
    assert kv.take(engines) is None
    return kv


def cache(kv: KvRouting, engine_id: str, ids: list[int]) -> None:
    """The engine's KV events: it holds the full blocks of `ids`."""
    blocks = len(ids) // 16
    for n in range(blocks):
        event = BlockStored([n + 1], n or None, ids[n * 16 : (n + 1) * 16], 16, None, "GPU", None)
        kv.engines[engine_id].index.apply(n, EventBatch(ts=0.0, events=[event]))


async def test_a_text_prompt_is_tokenized_by_an_engine_and_goes_where_its_prefix_is_cached(monkeypatch):
    monkeypatch.setenv("MOTOR_ENGINE_API_KEY", "engine-secret")
    engines = [Engine(), Engine()]
    served = [await serve_app(e.app()) for e in engines]
    kv = await routing([url for _, url in served])
    try:
        cache(kv, "e1", ids_of(SYSTEM + "first question"))
        decide = kv.deciding(lambda request: Forward())
        request = request_for({"model": "tiny", "prompt": SYSTEM + "second question"})
        pending = decide(request)
        assert isinstance(pending, asyncio.Future), "a real engine's text prompt is tokenized before the choice"
        decision = await pending
        assert decision.engine == served[1][1], "not sent to the engine holding the prompt's prefix"
        asked = engines[0].asked + engines[1].asked
        assert asked == [({"model": "tiny", "prompt": SYSTEM + "second question"}, "Bearer engine-secret")]
        assert kv.engines["e1"].in_flight == 1
        kv.ending(lambda request, passed: None)(request, None)
        assert kv.engines["e1"].in_flight == 0

        # a chat: its messages and template options asked as they came
        chat = request_for({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": []})
        chat.path = "/v1/chat/completions"
        await decide(chat)
        assert (engines[0].asked + engines[1].asked)[-1][0] == {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [],
        }

        # token ids given: no call at all
        calls = len(engines[0].asked + engines[1].asked)
        decision = decide(request_for({"model": "tiny", "prompt": ids_of(SYSTEM + "x")}))
        assert isinstance(decision, Forward) and decision.engine == served[1][1]
        assert len(engines[0].asked + engines[1].asked) == calls
    finally:
        await kv.close()
        for runner, _ in served:
            await runner.cleanup()


async def test_a_tokenizer_that_fails_or_is_slow_leaves_the_request_to_the_router():
    failing, slow = Engine(status=500), Engine(delay=3)
    for engine in (failing, slow):
        runner, url = await serve_app(engine.app())
        kv = await routing([url])
        try:
            decision = await kv.deciding(lambda request: Forward(CHANGED))(
                request_for({"model": "tiny", "prompt": "x"})
            )
            assert decision.engine is None and decision.body == CHANGED  # the router's, as decided
            assert kv.engines["e0"].in_flight == 0
        finally:
            await kv.close()
            await runner.cleanup()


def test_what_is_asked_of_tokenize():
    def asked(path: str, body: bytes):
        request = json_object(body)
        return None if request is None else tokenize_request(path, request, "m")

    assert asked("/v1/completions", b'{"prompt": ["one"]}') == {"model": "m", "prompt": "one"}
    assert asked("/v1/completions", b'{"prompt": ["one", "two"]}') is None  # two answers
    assert asked("/v1/completions", b'{"prompt": 3}') is None
    assert asked("/v1/chat/completions", b'{"messages": []}') is None
    assert asked("/v1/completions", b"[1]") is None
    assert asked("/v1/completions", b"{") is None


class TokenizingEngine:
    """An engine: /tokenize after `delay`, completions answered (the router stand-in's)."""

    def __init__(self, delay: float) -> None:
        self.tokenizer, self.completions = Engine(delay=delay), StandIn()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/tokenize", self.tokenizer.tokenize)
        app.router.add_post("/v1/completions", self.completions.completion)
        return app


async def test_a_client_gone_while_its_prompt_is_tokenized_gives_back_what_it_took(tmp_path):
    """The tenant's only concurrent slot and the engine's place are given back when the client
    leaves before the door has chosen; a request waiting on /tokenize then goes on as usual."""
    engine = TokenizingEngine(delay=0.5)
    runner, url = await serve_app(engine.app())
    door, _, cleanup = await keyed_door(tmp_path / "keys.yaml", {"acme": {"limits": {"concurrent_requests": 1}}})
    kv = KvRouting.install(door, type("Table", (), {"take_engines": None})())
    assert kv.take([{"engine_id": "e0", "generation": 1, "url": url, "models": ["m"], "tokenizer": "/m"}]) is None
    request = post(
        "/v1/completions", {"model": "m", "prompt": "hello there"}, [("Authorization", f"Bearer {KEYS['acme']}")]
    )
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
        writer.write(request)
        await asyncio.sleep(0.1)
        writer.close()  # gone while the engine tokenizes
        await asyncio.sleep(0.8)
        assert kv.engines["e0"].in_flight == 0 and engine.completions.seen == []
        answer = await exchange(door.port, request)  # 429 if the slot had not been given back
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        assert len(engine.completions.seen) == 1, "not sent to the engine the door chose"
        assert kv.engines["e0"].in_flight == 0
    finally:
        await kv.close()
        await cleanup()
        await runner.cleanup()
