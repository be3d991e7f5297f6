"""A streamed answer the router ends before its `data: [DONE]` is never silently truncated
(front_door/streams.py; issue 56, item 3): the client gets the events that came, then an OpenAI
error event, then the answer's proper end, never `[DONE]`; a whole stream passes unchanged."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from aiohttp import web

from front_door.policy import FrontDoor
from front_door.streams import Hooks, Stream
from motor.ports import free_port
from tests.support import serve_app

EVENTS = [b'data: {"id":"c","choices":[{"index":0,"text":"%d"}]}\n\n' % i for i in range(3)]
DONE = b"data: [DONE]\n\n"
BODY = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 8, "stream": True}).encode()


async def streaming(request: web.Request) -> web.StreamResponse:
    """The stand-in router: three events, then what the test's path asks for."""
    await request.read()
    how = request.query.get("end", "done")
    if how == "plain":  # not a stream: passed as it came
        return web.json_response({})
    reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await reply.prepare(request)
    for event in EVENTS:
        await reply.write(event)
        await asyncio.sleep(0.01)  # each its own read
    if how == "done":
        await reply.write(DONE[:9])  # `[DONE]` split across reads
        await asyncio.sleep(0.01)
        await reply.write(DONE[9:])
    elif how == "break":  # mid-event, then the connection breaks: no terminating chunk
        await reply.write(b'data: {"id":"c","cho')
        await asyncio.sleep(0.01)
        request.transport.close()
        return reply
    await reply.write_eof()  # "clean": the answer ends properly, without `[DONE]`
    return reply


@pytest.fixture
async def door():
    app = web.Application()
    app.router.add_post("/v1/completions", streaming)
    app.router.add_post("/v1/chat/completions", streaming)
    app.router.add_post("/v1/responses", streaming)
    runner, url = await serve_app(app)
    front = FrontDoor(url, lambda: {"m": None})
    front.port = free_port()
    await front.start("127.0.0.1", front.port)
    yield front
    await front.close()
    await runner.cleanup()


def post(path: str) -> bytes:
    return (
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: door\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
    )


async def answers(port: int, *paths: str) -> list[tuple[bytes, bytes, bool]]:
    """Each path's answer on one kept-alive connection: (head, body de-chunked, whether its
    chunked body ended with the terminating chunk)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    seen = []
    try:
        for path in paths:
            writer.write(post(path))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            body, ended = b"", False
            while True:
                size_line = await asyncio.wait_for(reader.readline(), 5)
                if not size_line:
                    break  # the connection closed before the answer's end
                size = int(size_line.strip(), 16)
                chunk = await reader.readexactly(size + 2)
                if size == 0:
                    ended = True
                    break
                body += chunk[:-2]
            seen.append((head, body, ended))
            if not ended:
                break
    finally:
        writer.close()
    return seen


def error_events(body: bytes) -> list[dict]:
    return [
        json.loads(event[len(b"data: ") :])["error"]
        for event in body.split(b"\n\n")
        if event.startswith(b"data: {") and b'"error"' in event
    ]


def cut_count(door: FrontDoor) -> float:
    return door.metrics.registry.get_sample_value("motor_front_door_streams_cut_total", {"model": "m"}) or 0.0


@pytest.mark.parametrize("end", ["clean", "break"])
async def test_a_stream_ended_before_done_ends_with_an_error_event_and_the_connection_carries_on(door, end):
    [(head, body, ended), (_, after, after_ended)] = await answers(
        door.port, f"/v1/completions?end={end}", "/v1/chat/completions?end=done"
    )
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    assert body.startswith(b"".join(EVENTS)), body  # every event that came, unchanged
    [error] = error_events(body)
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError" and "cut" in error["message"]
    assert body.endswith(b"\n\n") and b"[DONE]" not in body
    assert ended  # the answer's proper end: the client's connection carries its next request
    assert after == b"".join(EVENTS) + DONE and after_ended
    assert cut_count(door) == 1


async def test_a_whole_stream_passes_unchanged_done_split_across_reads(door):
    [(head, body, ended)] = await answers(door.port, "/v1/completions?end=done")
    assert body == b"".join(EVENTS) + DONE and ended
    assert cut_count(door) == 0


async def test_an_openai_client_raises_on_a_cut_stream_and_reads_a_whole_one(door):
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{door.port}/v1", api_key="none", max_retries=0)
    texts = []
    with pytest.raises(openai.APIError, match="cut"):
        async for chunk in await client.completions.create(
            model="m", prompt="hi", stream=True, extra_query={"end": "break"}
        ):
            texts.append(chunk.choices[0].text)
    assert texts == ["0", "1", "2"]
    whole = [
        chunk.choices[0].text
        async for chunk in await client.completions.create(
            model="m", prompt="hi", stream=True, extra_query={"end": "done"}
        )
    ]
    assert whole == ["0", "1", "2"]
    await client.close()


async def test_streams_of_other_apis_and_answers_that_are_not_streams_pass_as_they_came(door):
    """The Responses API ends its streams without `[DONE]`: not observed, so not called cut."""
    [(_, body, ended)] = await answers(door.port, "/v1/responses?end=clean")
    assert body == b"".join(EVENTS) and ended and not error_events(body)
    reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
    writer.write(post("/v1/completions?end=plain"))
    reply = await asyncio.wait_for(reader.readuntil(b"{}"), 5)
    writer.close()
    assert reply.startswith(b"HTTP/1.1 200") and b"application/json" in reply
    assert cut_count(door) == 0


@pytest.mark.parametrize("end", ["done", "clean"])
async def test_an_http_10_client_s_stream_ends_with_its_connection_after_the_error_event_if_cut(door, end):
    """HTTP/1.0 has no chunks: the answer ends when the connection does, the error event before."""
    reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
    writer.write(post(f"/v1/completions?end={end}").replace(b"HTTP/1.1", b"HTTP/1.0"))
    reply = await asyncio.wait_for(reader.read(), 5)  # to the connection's end
    writer.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b"chunked" not in head.lower()
    assert body.startswith(b"".join(EVENTS))
    if end == "done":
        assert body == b"".join(EVENTS) + DONE and cut_count(door) == 0
    else:
        assert len(error_events(body)) == 1 and b"[DONE]" not in body and cut_count(door) == 1


class Written:
    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


def stream_of(*pieces: bytes) -> tuple[bytes, list[str]]:
    """What a (close-delimited) Stream writes for the router's body in `pieces`, and the cuts it reported."""
    written, cuts = Written(), []
    stream = Stream(written, None, chunked=False, hooks=Hooks(cut=lambda request, how: cuts.append(how)))
    for piece in pieces:
        stream.body(piece)
        stream.flush()
    stream.end(broken=True)
    return written.data, cuts


@pytest.mark.parametrize(
    "pieces",
    [
        [b"data: 1\n\ndata: [DO", b"NE]\n\n"],
        [b"data: 1\r\n\r\ndata:[DONE]\r", b"\n\r\n"],  # CRLF lines, no space after the colon
        [b"data: 1\r\rdata: [DONE]\r\r\n"],
    ],
)
def test_a_stream_ending_with_done_however_split_is_whole(pieces):
    data, cuts = stream_of(*pieces)
    assert data == b"".join(pieces) and cuts == []


@pytest.mark.parametrize(
    "pieces",
    [
        [b"data: 1\n\n", b'data: {"half'],  # half an event: never written, the error event in its place
        [b"data: 1\n\ndata: [DONE]\n"],  # an event unended at the end is discarded (SSE), so is this [DONE]
        [b"data: [DONE]\n\n", b"data: 2\n\n"],  # something after [DONE]
        [b"data: 1\n\n", b"\n"],  # whitespace after an event that is not [DONE]
        [],
    ],
)
def test_a_stream_without_a_last_done_is_cut_and_no_half_event_is_written(pieces):
    data, cuts = stream_of(*pieces)
    assert len(cuts) == 1 and b"half" not in data
    events = [event for event in data.split(b"\n\n") if event]
    assert json.loads(events[-1][len(b"data: ") :])["error"]["code"] == 503
