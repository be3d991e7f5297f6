"""Streams gone on with at their edges (front_door/continuation.py, streams.py, resend.py): reads that
end inside events, requests without limits or with nulls, a router that found no engine first,
reasoning, logprobs, gzip bodies, engines that refuse, metrics; and what held up in a hostile read
(tests named `test_holds_...`). Each docstring says what a user sees."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from front_door import resend
from front_door.policy import FrontDoor
from tests.support.continuation_engine import (
    BODY,
    Engine,
    answer_ids,
    door_before,
    ids_shown,
    prompt_ids,
    stream,
    text,
    text_of,
)


class Scripted(Engine):
    """The stand-in engine, whose answer is written as the test says: `framing(events)` gives the
    writes (bytes, or a float: seconds to sleep); `cut` ("break", k) breaks the connection after k
    tokens; `extra(chunk, n)` changes each token's chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.framing = None
        self.extra = None
        self.plain: list = []  # per request: a coroutine factory that answers it instead

    def events(self, body: dict, chat: bool) -> list[bytes]:
        prompt = prompt_ids(body)
        limit = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        ids = answer_ids(prompt, limit)
        asked = body.get("return_token_ids") is True
        head = {"id": f"cmpl-{len(self.bodies)}", "object": "chat.completion.chunk" if chat else "text_completion"}
        head.update(created=1000 + len(self.bodies), model=body["model"])
        out = []
        if chat:
            first = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
            out.append({**head, **first, **({"prompt_token_ids": prompt} if asked else {})})
        whole = prompt + ids
        offset = 0
        for n, token in enumerate(ids):
            piece = text_of(whole, len(prompt) + n)
            last = "length" if n == len(ids) - 1 else None
            choice = {"index": 0, "finish_reason": last}
            choice.update({"delta": {"content": piece}} if chat else {"text": piece})
            if asked:
                choice["token_ids"] = [token]
                if not chat and n == 0:
                    choice["prompt_token_ids"] = prompt
            lp = body.get("logprobs")
            if chat and lp is True:
                top = body.get("top_logprobs") or 0
                alts = [{"token": piece, "logprob": -0.1, "bytes": list(piece.encode())}]
                alts += [
                    {"token": f" alt{k}", "logprob": -2.0 - k, "bytes": list(f" alt{k}".encode())} for k in range(5)
                ]
                choice["logprobs"] = {"content": [{**alts[0], "top_logprobs": alts[:top]}]}
            elif not chat and isinstance(lp, int):
                tops = {piece: -0.1, **{f" alt{k}": -2.0 - k for k in range(5)}}
                choice["logprobs"] = {
                    "tokens": [piece],
                    "token_logprobs": [-0.1],
                    "top_logprobs": [dict(list(tops.items())[: max(lp, 1)])],
                    "text_offset": [offset],
                }
            offset += len(piece)
            chunk = {**head, "choices": [choice]}
            if (body.get("stream_options") or {}).get("continuous_usage_stats"):
                chunk["usage"] = {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": n + 1,
                    "total_tokens": len(prompt) + n + 1,
                }
            if self.extra:
                chunk = self.extra(chunk, n, body)
            out.append(chunk)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(whole)}
            out.append({**head, "choices": [], "usage": usage})
        return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in out] + [b"data: [DONE]\n\n"]

    async def serve(self, request: web.Request) -> web.StreamResponse:
        if self.plain:
            self.bodies.append(json.loads(await request.read()))
            return await self.plain.pop(0)(request)
        raw = await request.read()
        body = json.loads(raw)
        if self.framing is None or not body.get("stream"):
            return await super().serve(_Replay(request, raw))
        self.bodies.append(body)
        how, at = self.faults.pop(0) if self.faults else ("", -1)
        if how == "status":
            return web.json_response({"error": {"message": "no workers", "code": at}}, status=at)
        chat = request.path.endswith("/chat/completions")
        events = self.events(body, chat)
        if how == "break":
            events = events[: at + (1 if chat else 0)]
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        for piece in self.framing(events):
            if isinstance(piece, float):
                await asyncio.sleep(piece)
            else:
                await reply.write(piece)
        if how == "break":
            await asyncio.sleep(0.01)
            request.transport.close()
            return reply
        await reply.write_eof()
        return reply


class _Replay:
    """An aiohttp request whose body was read already (for Engine.serve)."""

    def __init__(self, request: web.Request, raw: bytes) -> None:
        self._request, self._raw = request, raw

    def __getattr__(self, name):
        return getattr(self._request, name)

    async def read(self) -> bytes:
        return self._raw


@pytest.fixture
async def door():
    engine = Scripted()
    async with door_before(engine) as front:
        yield engine, front


def one_by_one(events):
    for event in events:
        yield event
        yield 0.002


def split_mid_event(events):
    """As TCP delivers a busy stream: a read holds whole events and the start of the next."""
    data = b"".join(events)
    step = 3 * len(events[1]) // 2
    for at in range(0, len(data), step):
        yield data[at : at + step]
        yield 0.003


async def test_a_stream_whose_reads_end_inside_an_event_is_still_followed(door):
    """A stream whose reads from the router do not end on event boundaries (any busy stream over
    TCP: a read holds whole events and the first bytes of the next) is still followed: the token ids
    the client did not ask for stay hidden."""
    engine, front = door
    engine.framing = split_mid_event
    body = {**BODY, "max_tokens": 40}
    whole, _ = await stream(front.port, "/v1/completions", body)
    assert whole[-1] == "[DONE]"
    assert not ids_shown(whole), "token ids the client did not ask for are shown"
    engine.faults = [("break", 20)]
    events, ended = await stream(front.port, "/v1/completions", body)
    assert events[-1] == "[DONE]" and text(events, False) == text(whole, False), events[-1]


async def test_a_cut_stream_whose_reads_end_inside_an_event_is_gone_on_with(door):
    """The same, when its engine dies: the rest of the answer comes from another engine."""
    engine, front = door
    engine.framing = split_mid_event
    body = {**BODY, "max_tokens": 40}
    engine.faults = [("break", 20)]
    events, ended = await stream(front.port, "/v1/completions", body)
    assert events[-1] == "[DONE]", events[-1]
    assert len(engine.bodies) == 2


async def test_a_completion_without_max_tokens_keeps_its_default_length_when_cut(door):
    """No `max_tokens` in a completion: the engine's default applies (vLLM's and the sim's: 16). The
    continuation asks for what is left of those 16, not 16 more."""
    engine, front = door
    body = {"model": "m", "stream": True, "temperature": 0, "prompt": "tell me"}
    whole, _ = await stream(front.port, "/v1/completions", body)
    engine.faults = [("break", 10)]
    events, _ = await stream(front.port, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    assert engine.bodies[-1]["max_tokens"] == 16 - 10, engine.bodies[-1]
    assert text(events, False) == text(whole, False)


async def test_a_chat_without_max_tokens_is_not_gone_on_with_but_ends_with_an_error_event(door):
    """No limit in a chat completion: vLLM answers to the end of the context, which the door does
    not know, so it cannot ask a completion for the rest; cut, the stream ends with an error event
    (never a wrong length) and the engine was not asked for token ids."""
    engine, front = door
    body = {"model": "m", "stream": True, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    engine.faults = [("break", 10)]
    events, _ = await stream(front.port, "/v1/chat/completions", body)
    assert "[DONE]" not in events and "error" in events[-1]
    assert len(engine.bodies) == 1 and "return_token_ids" not in engine.bodies[0]


async def test_max_tokens_null_with_max_completion_tokens_limits_the_continuation(door):
    """A chat request with `"max_tokens": null, "max_completion_tokens": 30` (clients that write
    every field, nulls included): the continuation asks for what is left of the 30."""
    engine, front = door
    engine.framing = one_by_one
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    body.update(max_tokens=None, max_completion_tokens=12)
    whole, _ = await stream(front.port, "/v1/chat/completions", body)
    assert text(whole, True).count(" w") == 12
    engine.faults = [("break", 8)]
    events, _ = await stream(front.port, "/v1/chat/completions", body)
    assert engine.bodies[-1].get("max_tokens") == 4, engine.bodies[-1]
    assert text(events, True) == text(whole, True)


async def test_a_stream_answered_after_a_router_500_is_followed_and_hides_token_ids(door):
    """A streamed request whose first try the router answered with its own plain-text 500 (no engine
    for a moment) is sent again; the engine's stream that then comes is followed like a first one:
    token ids the client did not ask for stay hidden."""
    engine, front = door
    engine.faults = [("router_failed", 0)]
    events, ended = await stream(front.port, "/v1/completions", BODY)
    assert events[-1] == "[DONE]" and len(engine.bodies) == 2
    answers = [e for e in events if isinstance(e, dict)]
    assert not ids_shown(events), "token ids shown to a client that did not ask"
    assert not any("prompt_token_ids" in c for e in answers for c in e["choices"])


async def test_a_stream_answered_after_a_router_500_and_then_cut_is_gone_on_with(door):
    """The same request, its engine then dying mid-stream: gone on with on another engine, never a
    silent end."""
    engine, front = door
    engine.faults = [("router_failed", 0), ("end", 10)]
    events, ended = await stream(front.port, "/v1/completions", BODY)
    assert events[-1] == "[DONE]" or "error" in events[-1], events[-1]


def reasoning(chunk: dict, n: int, body: dict) -> dict:
    """A chat answer through a reasoning parser: its first 20 tokens' text is `reasoning_content`."""
    for choice in chunk.get("choices", []):
        delta = choice.get("delta")
        if delta is not None and n < 20 and "content" in delta:
            delta["reasoning_content"] = delta.pop("content")
    return chunk


async def test_reasoning_text_sent_before_a_cut_is_not_sent_again(door):
    """A chat answer of a reasoning model (vLLM's `--reasoning-parser`: the thinking comes as
    `delta.reasoning_content`) cut while it thinks: the reasoning shown counts as text that came, so
    it is not sent again."""
    engine, front = door
    engine.framing = one_by_one
    engine.extra = reasoning
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "stream": True}
    whole, _ = await stream(front.port, "/v1/chat/completions", body)

    def all_text(events):
        return "".join(
            (c.get("delta") or {}).get(key) or ""
            for e in events
            if isinstance(e, dict)
            for c in e.get("choices", [])
            for key in ("reasoning_content", "content")
        )

    engine.faults = [("break", 15)]
    events, _ = await stream(front.port, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    assert all_text(events) == all_text(whole), (all_text(events), all_text(whole))


async def test_chat_logprobs_without_top_logprobs_keep_their_shape_after_a_cut(door):
    """Chat with `logprobs: true` and no `top_logprobs`: each token's entry has `top_logprobs: []`,
    after the cut too (the continuation, a completion with `logprobs: 0`, gets the sampled token in
    each step's top_logprobs from vLLM: the door keeps none)."""
    engine, front = door
    engine.framing = one_by_one
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}
    body["logprobs"] = True
    engine.faults = [("break", 8)]
    events, _ = await stream(front.port, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    entries = [
        x
        for e in events
        if isinstance(e, dict)
        for c in e["choices"]
        for x in ((c.get("logprobs") or {}).get("content") or [])
    ]
    assert len(entries) == 20
    assert [len(x["top_logprobs"]) for x in entries] == [0] * 20


def in_flight(front: FrontDoor) -> float:
    return front.metrics.registry.get_sample_value("motor_front_door_requests_in_flight") or 0.0


def lps(events, key):
    return [
        x for e in events if isinstance(e, dict) for c in e["choices"] for x in (c.get("logprobs") or {}).get(key, [])
    ]


async def test_completion_logprobs_text_offsets_go_on_from_the_cut(door):
    """A completion with `logprobs: 2` cut after 7 tokens: the continuation's `text_offset`s (counted
    by its engine from the continuation's own start) are shifted by the text sent at the cut."""
    engine, front = door
    engine.framing = one_by_one
    body = {**BODY, "logprobs": 2}
    whole, _ = await stream(front.port, "/v1/completions", body)
    engine.faults = [("break", 7)]
    events, ended = await stream(front.port, "/v1/completions", body)
    assert ended and events[-1] == "[DONE]" and text(events, False) == text(whole, False)
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert lps(events, key) == lps(whole, key), key
    assert lps(events, "text_offset") == lps(whole, "text_offset")


async def test_holds_continuous_usage_chat_logprobs_and_pipelining(door):
    """(Checks that held up: kept as a guard.) `continuous_usage_stats` through two cuts, chat
    `top_logprobs: 2` through two cuts, and a request pipelined behind a continued stream."""
    engine, front = door
    engine.framing = one_by_one
    body = {**BODY, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    whole, _ = await stream(front.port, "/v1/completions", body)
    engine.faults = [("break", 7), ("break", 9)]
    events, ended = await stream(front.port, "/v1/completions", body)
    assert ended and events[-1] == "[DONE]" and text(events, False) == text(whole, False)
    usages = [e["usage"]["completion_tokens"] for e in events if isinstance(e, dict) and e.get("usage")]
    assert usages == sorted(usages) and usages[-1] == 40, usages
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 25, "stream": True}
    chat.update(logprobs=True, top_logprobs=2)
    whole, _ = await stream(front.port, "/v1/chat/completions", chat)
    engine.faults = [("break", 5), ("break", 6)]
    events, ended = await stream(front.port, "/v1/chat/completions", chat)
    assert text(events, True) == text(whole, True)

    def content(evs):
        return [
            x
            for e in evs
            if isinstance(e, dict)
            for c in e["choices"]
            for x in ((c.get("logprobs") or {}).get("content") or [])
        ]

    assert content(events) == content(whole)
    # pipelined: two requests in one write, the first cut and gone on with
    engine.faults = [("break", 5)]
    data = json.dumps({**BODY, "max_tokens": 10}).encode()
    one = b"POST /v1/completions HTTP/1.1\r\nHost: d\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(one + one)
    got = b""
    while got.count(b"data: [DONE]") < 2:
        piece = await asyncio.wait_for(reader.read(65536), 10)
        assert piece, got[-300:]
        got += piece
    writer.close()
    assert got.count(b"HTTP/1.1 200") == 2 and b'"error"' not in got
    await asyncio.sleep(0.1)
    assert in_flight(front) == 0


async def test_holds_a_client_gone_while_the_door_waits_for_an_engine(door, monkeypatch):
    """(Held up.) The client leaves during the wait for an engine to go on with its stream: no more
    tries are sent, the in-flight gauge is back to 0."""
    engine, front = door
    engine.framing = one_by_one
    engine.faults = [("break", 3)] + [("status", 503)] * 1000
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    data = json.dumps(BODY).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: d\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
    await asyncio.wait_for(reader.readuntil(b"w"), 5)
    await asyncio.sleep(1.0)
    asked = len(engine.bodies)
    assert asked > 3
    writer.close()
    await asyncio.sleep(1.5)
    assert len(engine.bodies) <= asked + 1
    assert in_flight(front) == 0


REFUSAL = {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}


def refused_at_fifth_chunk(chunk, n, body):
    """An engine's 4xx error event (the request's own fault) in place of the fifth chunk."""
    return {"error": REFUSAL} if n == 5 else chunk


async def test_holds_an_engine_4xx_error_event_mid_stream_then_done(door):
    """(Held up.) An engine's error event with a 4xx code mid-stream, then [DONE]: passed on as it came."""
    engine, front = door
    engine.framing = one_by_one
    engine.extra = refused_at_fifth_chunk
    events, ended = await stream(front.port, "/v1/completions", BODY)
    assert REFUSAL in [e.get("error") for e in events if isinstance(e, dict)]
    assert len(engine.bodies) == 1


def crlf(events):
    for event in events:
        yield event.replace(b"\n", b"\r\n")
        yield 0.002


async def test_holds_crlf_framed_events(door):
    """(Held up.) Events framed with CRLF, as SSE allows: ids hidden, a cut gone on with."""
    engine, front = door
    engine.framing = crlf
    whole, _ = await stream(front.port, "/v1/completions", BODY)
    engine.faults = [("break", 10)]
    raw_events, ended = await stream(front.port, "/v1/completions", BODY)
    assert not ids_shown(whole)
    assert raw_events[-1] == "[DONE]" and text(raw_events, False) == text(whole, False)


async def test_a_long_prompt_stream_written_event_by_event_is_followed(door):
    """(Held up here.) A 60,000-token prompt: its first event (`prompt_token_ids`) is a few hundred
    kB, read in several reads; on loopback with one event per write, the reads here ended on event
    boundaries and the stream was followed (the split-read finding above needs a read that ends
    inside an event after a whole one)."""
    engine, front = door
    engine.framing = one_by_one
    body = {**BODY, "prompt": [100 + i % 50 for i in range(60_000)], "max_tokens": 30}
    engine.faults = [("break", 20)]
    events, ended = await stream(front.port, "/v1/completions", body)
    assert not ids_shown(events), "token ids shown to a client that did not ask"
    assert events[-1] == "[DONE]", events[-1]


async def test_a_gzip_encoded_stream_request_is_gone_on_with(door, monkeypatch):
    """A streamed request with a gzip-encoded body (`Content-Encoding: gzip`), cut: the continuation's
    plain JSON body goes without the client's `Content-Encoding`."""
    import gzip

    engine, front = door
    monkeypatch.setattr(resend, "CONTINUE_WITHIN", 3.0)
    whole, _ = await stream(front.port, "/v1/completions", BODY)
    engine.faults = [("break", 10)]
    events, _ = await stream(
        front.port, "/v1/completions", None, gzip.compress(json.dumps(BODY).encode()), b"Content-Encoding: gzip\r\n"
    )
    assert events[-1] == "[DONE]" and text(events, False) == text(whole, False), events[-1]


async def test_holds_no_model_and_a_split_character_cut_twice(door):
    """(Held up.) A body without `model` (the door names it, in the continuation too); a cut right
    after half a character, the continuation cut again right after making that token again, and the
    next one cut before its first event."""
    from tests.support.continuation_engine import SPLIT

    engine, front = door
    whole, _ = await stream(front.port, "/v1/completions", BODY)
    no_model = {k: v for k, v in BODY.items() if k != "model"}
    engine.faults = [("break", 10)]
    events, _ = await stream(front.port, "/v1/completions", no_model)
    assert events[-1] == "[DONE]" and text(events, False) == text(whole, False)
    assert engine.bodies[-1]["model"] == "m"
    body = {**BODY, "max_tokens": 60}
    whole, _ = await stream(front.port, "/v1/completions", body)
    ids = answer_ids(prompt_ids(body), 60)
    at = ids.index(SPLIT)
    engine.faults = [("break", at + 1), ("break", 1), ("break", 0)]
    events, _ = await stream(front.port, "/v1/completions", body)
    assert events[-1] == "[DONE]" and text(events, False) == text(whole, False)
    answers = [e for e in events if isinstance(e, dict)]
    assert answers[-1]["choices"][0]["finish_reason"] == "length" and "<the prompt" not in text(events, False)


async def test_an_engine_that_refuses_the_continuation_with_a_4xx_ends_the_stream_saying_why(door, monkeypatch):
    """The engine answers the continuation with a 4xx of its own (a JSON 400: the prompt of ids over
    its context; a 404: the adapter was unloaded): not retried, the stream ends at once with an
    error event that says what the engine said."""
    engine, front = door
    monkeypatch.setattr(resend, "CONTINUE_WITHIN", 3.0)
    engine.faults = [("break", 5)] + [("status", 400)] * 100
    started = asyncio.get_running_loop().time()
    events, ended = await stream(front.port, "/v1/completions", BODY)
    took = asyncio.get_running_loop().time() - started
    assert "error" in events[-1]
    assert len(engine.bodies) == 2, f"the 400 was asked again {len(engine.bodies) - 2} times"
    assert took < 1.0, took


def requests_counted(front: FrontDoor, code: str) -> float:
    return (
        front.metrics.registry.get_sample_value("motor_front_door_requests_total", {"model": "m", "code": code}) or 0.0
    )


async def test_the_doors_own_503_after_router_500s_is_counted_as_503(door):
    """A request the router answered with its own 500 four times: the client gets the door's 503, and
    `motor_front_door_requests_total` files it under code 503."""
    engine, front = door
    engine.faults = [("router_failed", 0)] * 4
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    data = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 5}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: d\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    writer.close()
    assert head.startswith(b"HTTP/1.1 503")
    await asyncio.sleep(0.05)
    assert (requests_counted(front, "503"), requests_counted(front, "500")) == (1, 0)


def continued_total(front: FrontDoor) -> float:
    sample = {"model": "m", "reason": "broken"}
    return front.metrics.registry.get_sample_value("motor_front_door_continuations_total", sample) or 0.0


async def test_a_continuation_cut_before_its_first_event_is_counted(door):
    """Cut after 5 tokens; the continuation's engine dies before its first event; the next one
    answers. Two continuations were asked, and both are counted."""
    engine, front = door
    engine.framing = one_by_one
    engine.faults = [("break", 5), ("break", 0)]
    events, _ = await stream(front.port, "/v1/completions", BODY)
    assert events[-1] == "[DONE]" and len(engine.bodies) == 3
    assert continued_total(front) == 2


async def test_holds_a_slow_client_through_a_continuation(door):
    """(Held up.) A client that reads nothing for a while (its socket buffers full: the door stops
    reading the router), the engine dying meanwhile, then reading it all: the whole answer."""
    engine, front = door
    engine.framing = one_by_one
    pad = "x" * 4000

    def big(chunk, n, body):
        for choice in chunk.get("choices", []):
            if "text" in choice:
                choice["text"] += pad
        return chunk

    engine.extra = big
    body = {**BODY, "max_tokens": 400}
    whole, _ = await stream(front.port, "/v1/completions", body)
    engine.faults = [("break", 300)]
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port, limit=1024)
    writer.transport.set_write_buffer_limits(0)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: d\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
    await asyncio.sleep(2.0)  # not read: the door is held back by the client
    got = b""
    while not got.endswith(b"0\r\n\r\n"):
        piece = await asyncio.wait_for(reader.read(1 << 20), 10)
        assert piece
        got += piece
    writer.close()
    assert got.count(pad.encode()) == 400 and b'"error"' not in got and b"data: [DONE]" in got


async def test_a_4xx_error_event_then_an_end_without_done_ends_the_stream_there(door):
    """An engine's 4xx error event mid-stream (the request's own fault) followed by the stream ending
    without `[DONE]`: the engine's error is the stream's last event, not gone on with."""
    engine, front = door
    engine.framing = one_by_one
    engine.extra = refused_at_fifth_chunk

    def no_done(events):
        for event in events[:6]:  # 5 tokens, the error event, and no more
            yield event
            yield 0.002

    engine.framing = no_done
    events, ended = await stream(front.port, "/v1/completions", BODY)
    errors = [i for i, e in enumerate(events) if isinstance(e, dict) and "error" in e]
    assert errors and errors[0] == len(events) - 1, f"events after the error: {events[errors[0] + 1 :][:2]}"
    assert len(engine.bodies) == 1


@pytest.mark.parametrize(
    "extra, continued",
    [
        ({"guided_json": {"type": "object"}, "tool_choice": "none"}, False),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, False),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}, True),
    ],
    ids=["guided-with-tool-choice-none", "tools", "tools-not-called"],
)
async def test_guided_decoding_and_callable_tools_are_not_gone_on_with(door, extra, continued):
    """Guided decoding's state (and a tool call's parsing) lives in the engine: such a stream, cut,
    ends with an error event, whatever `tool_choice` says; tools the model may not call are plain text."""
    engine, front = door
    engine.faults = [("break", 3)]
    events, _ = await stream(front.port, "/v1/completions", {**BODY, **extra})
    assert (events[-1] == "[DONE]") is continued, events[-2:]
