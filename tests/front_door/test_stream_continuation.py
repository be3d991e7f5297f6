"""A stream cut by its engine goes on with another engine's answer, token for token
(front_door/continuation.py, front_door/streams.py): the client reads one stream (one id, no token
repeated or missing, the whole answer's usage and finish_reason, `[DONE]`), token ids shown only if
it asked; where it cannot go on, the stream ends with an OpenAI error event as before.

The stand-in router here is an engine of a deterministic model (each token a function of every id
before it, as greedy decoding of a real one): a continuation from the prompt's ids and the ids sent
gives exactly the rest of the uninterrupted answer. Each request takes the next of `faults`: how its
answer is cut (after how many tokens, and how), or a status to refuse it with."""

from __future__ import annotations

import asyncio
import json

import pytest

from front_door import resend
from front_door.policy import FrontDoor
from tests.support.continuation_engine import (
    BODY,
    SPLIT,
    Engine,
    answer_ids,
    door_before,
    ids_shown,
    prompt_ids,
    stream,
    text,
)


@pytest.fixture
async def stack():
    engine = Engine()
    async with door_before(engine) as front:
        yield engine, front


def counted(front: FrontDoor, reason: str) -> float:
    sample = {"model": "m", "reason": reason}
    return front.metrics.registry.get_sample_value("motor_front_door_continuations_total", sample) or 0.0


@pytest.mark.parametrize("how", ["break", "end", "error"])
async def test_a_cut_completion_goes_on_token_for_token_as_one_answer(stack, how):
    engine, front = stack
    body = {**BODY, "stream_options": {"include_usage": True}}
    whole, ended = await stream(front.port, "/v1/completions", body)
    assert ended and whole[-1] == "[DONE]"
    engine.faults = [(how, 12)]
    events, ended = await stream(front.port, "/v1/completions", body)
    assert ended and events[-1] == "[DONE]", events[-3:]
    assert not [e for e in events if isinstance(e, dict) and "error" in e]
    assert text(events, chat=False) == text(whole, chat=False)
    answers = [e for e in events if isinstance(e, dict)]
    assert len({e["id"] for e in answers}) == 1 and len({e["created"] for e in answers}) == 1
    assert not ids_shown(events) and not any("prompt_token_ids" in c for e in answers for c in e["choices"])
    assert answers[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 40, "total_tokens": 47}
    assert [c["finish_reason"] for e in answers for c in e["choices"] if c["finish_reason"]] == ["length"]
    # The rest was asked as a completion of the prompt's ids and the 12 sent, for what was left.
    rest = engine.bodies[-1]
    assert rest["prompt"] == prompt_ids(body) + answer_ids(prompt_ids(body), 12)
    assert rest["max_tokens"] == 28 and rest["temperature"] == 0 and rest["return_token_ids"] is True
    assert engine.bodies[1]["return_token_ids"] is True  # asked of the first engine, never shown
    reason = {"break": "broken", "end": "ended", "error": "engine_error"}[how]
    assert counted(front, reason) == 1


async def test_a_cut_chat_completion_goes_on_in_chat_chunks_with_the_ids_the_client_asked_for(stack):
    engine, front = stack
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 30}
    body.update(stream=True, return_token_ids=True)
    whole, _ = await stream(front.port, "/v1/chat/completions", body)
    engine.faults = [("break", 5), ("break", 17)]  # cut twice: on twice
    events, ended = await stream(front.port, "/v1/chat/completions", body)
    assert ended and events[-1] == "[DONE]"
    assert text(events, chat=True) == text(whole, chat=True)
    assert ids_shown(events) == ids_shown(whole) and len(ids_shown(events)) == 30
    answers = [e for e in events if isinstance(e, dict)]
    assert {e["object"] for e in answers} == {"chat.completion.chunk"} and len({e["id"] for e in answers}) == 1
    assert sum("prompt_token_ids" in e for e in answers) == 1  # the first chunk's, not the continuations'
    assert engine.bodies[-1]["max_tokens"] == 30 - 5 - 17 and "messages" not in engine.bodies[-1]
    assert counted(front, "broken") == 2


@pytest.mark.parametrize("asked", [False, True], ids=["text", "text-and-ids"])
async def test_a_character_split_across_two_tokens_at_the_cut_comes_once(stack, asked):
    engine, front = stack
    body = {**BODY, "max_tokens": 60, "return_token_ids": asked, "logprobs": None}
    whole, _ = await stream(front.port, "/v1/completions", body)
    ids = answer_ids(prompt_ids(body), 60)
    assert SPLIT in ids[:-1], "the model should emit the split token in this answer"
    engine.faults = [("break", ids.index(SPLIT) + 1)]  # cut after its first half was sent (as text "")
    events, _ = await stream(front.port, "/v1/completions", body)
    assert text(events, chat=False) == text(whole, chat=False) and text(whole, chat=False).count("é") >= 1
    # Gone on with from the token before the split one (a prompt ending mid-character makes vLLM
    # write the prompt's text first): that token made again, its id not shown twice.
    assert engine.bodies[-1]["prompt"] == prompt_ids(body) + ids[: ids.index(SPLIT)]
    assert ids_shown(events) == (ids if asked else [])


async def test_no_engine_for_a_while_is_waited_for_then_the_stream_goes_on(stack):
    engine, front = stack
    engine.faults = [("break", 3), ("status", 503), ("status", 503)]
    events, ended = await stream(front.port, "/v1/completions", BODY)
    assert ended and events[-1] == "[DONE]" and text(events, chat=False).count(" w") == 40
    assert len(engine.bodies) == 4


async def test_where_it_cannot_go_on_the_stream_ends_with_an_error_event_not_done(stack, monkeypatch):
    engine, front = stack
    monkeypatch.setattr(resend, "CONTINUE_WITHIN", 0.3)
    cases = [
        ({**BODY, "n": 2}, [("break", 3)]),  # n > 1
        ({**BODY, "stop": ["w1"]}, [("break", 3)]),  # stop strings
        (BODY, [("break", 3)] * 4),  # past the limit of 3
        (BODY, [("break", 3)] + [("status", 503)] * 30),  # no engine within the deadline
    ]
    for body, faults in cases:
        engine.faults = list(faults)
        events, ended = await stream(front.port, "/v1/completions", body)
        assert ended and "[DONE]" not in events, (body, events[-2:])
        assert "error" in events[-1], (body, events[-1])
    front.stream_continuations = 0  # (--stream-continuations 0): never gone on with
    engine.faults = [("break", 3)]
    events, _ = await stream(front.port, "/v1/completions", BODY)
    assert "error" in events[-1] and "return_token_ids" not in engine.bodies[-1]


async def test_a_stream_cut_after_its_last_token_gets_its_usage_and_done_from_the_door(stack):
    engine, front = stack
    engine.faults = [("end", 10)]
    body = {**BODY, "max_tokens": 10, "stream_options": {"include_usage": True}}
    events, ended = await stream(front.port, "/v1/completions", body)
    # (the stand-in ends after the finish_reason without its usage and [DONE]: "end" at the last token)
    assert ended and events[-1] == "[DONE]"
    assert events[-2]["usage"] == {"prompt_tokens": 7, "completion_tokens": 10, "total_tokens": 17}
    assert len(engine.bodies) == 1  # nothing asked of another engine


async def test_a_whole_answer_no_engine_gave_is_asked_again_and_answered_once(stack):
    engine, front = stack
    whole = {"model": "m", "prompt": "hi", "max_tokens": 5}
    engine.faults = [("router_failed", 0), ("router_failed", 0)]
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    data = json.dumps(whole).encode()
    request = b"POST /v1/completions HTTP/1.1\r\nHost: d\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)
    writer.write(request)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    assert json.loads(await reader.readexactly(length))["id"] == "whole"
    assert len(engine.bodies) == 3
    # More failures than the door's 3 tries: its own 503, in OpenAI's error shape, on the same connection.
    engine.faults = [("router_failed", 0)] * 4
    writer.write(request)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 503"), head
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    error = json.loads(await reader.readexactly(length))["error"]
    assert error["type"] == "ServiceUnavailableError" and "No engine answered" in error["message"]
    assert len(engine.bodies) == 3 + 4
    writer.write(request)  # the connection carries the next request
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200"), head
    writer.close()
