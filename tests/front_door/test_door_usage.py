"""The tokens a tenant's answer is charged (front_door/usage.py): no form of request or answer
takes fewer than the engine produced, or than the request allows where the door cannot read the
answer. Before: a Responses API answer (its counts after a nested details object, named
input/output_tokens), a chat answer whose `usage` came more than 4 KiB before its end (vLLM writes
`prompt_token_ids` after it), a `max_tokens` of null beside `max_completion_tokens`, and `n` > 1
were each charged 16 completion tokens, whatever they took."""

from __future__ import annotations

import json

import openai
from aiohttp import web

from front_door.messages import Request
from front_door.usage import WINDOW, UsageReader, estimate, usage_in
from tests.support.keyed_door import KEYS, StandIn, keyed_door

RESPONSES_USAGE = {
    "input_tokens": 12,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": 4000,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 4012,
}


def test_the_counts_of_every_usage_shape_are_read():
    assert usage_in(json.dumps({"output": [], "usage": RESPONSES_USAGE}).encode()) == (12, 4000)
    anthropic = {"type": "message", "usage": {"input_tokens": 9, "output_tokens": 30}}
    assert usage_in(json.dumps(anthropic).encode()) == (9, 30)
    chat = {"usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 2}, "completion_tokens": 7}}
    assert usage_in(json.dumps(chat).encode()) == (5, 7)
    assert usage_in(b'{"type": "usage", "x": {"prompt_tokens": 1}}') is None  # a value, not the key


class Written:
    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


def read_through(answer: bytes, cut: int) -> tuple[int, int] | None:
    """`answer` passed through a UsageReader in reads of `cut` bytes: what it wrote, the counts read."""
    path = "/v1/chat/completions"
    request = Request(method="POST", target=path, path=path, headers=[], body=b"{}", keep_alive=True, http_10=False)
    written = Written()
    reader = UsageReader(written, request, chunked=False)
    for at in range(0, len(answer), cut):
        reader.body(answer[at : at + cut])
        reader.flush()
    assert reader.end(broken=False)
    assert written.data == answer
    return request.usage


def test_usage_far_from_the_end_and_cut_between_reads_is_read():
    chat = {"choices": [{"message": {"content": "hi"}}], "usage": {"prompt_tokens": 1146, "completion_tokens": 8000}}
    answer = json.dumps({**chat, "prompt_token_ids": list(range(20000))}).encode()
    assert answer.index(b'"usage"') < len(answer) - 10 * WINDOW
    for cut in (7, 100, 1000, 4096, len(answer)):
        assert read_through(answer, cut) == (1146, 8000), cut


def test_the_estimate_takes_every_limit_field_and_every_choice():
    def completion(**fields) -> int:
        return estimate(json.dumps({"prompt": "x", **fields}).encode())[1]

    assert completion(max_tokens=None, max_completion_tokens=2000) == 2000
    assert completion(max_output_tokens=300) == 300
    assert completion(max_tokens=50, n=4) == 200
    assert completion(max_tokens=50, best_of=3, n=2) == 150
    assert completion(n=2) == 32 and completion() == 16  # no limit named: the default, per choice
    assert completion(max_tokens=True, n=False) == 16  # booleans are not counts


async def test_a_responses_answer_takes_its_output_tokens_from_the_tenants_budget(tmp_path):
    class Responses(StandIn):
        async def anything(self, request):
            self.seen.append({"path": request.path})
            return web.json_response({"id": "r", "object": "response", "output": [], "usage": RESPONSES_USAGE})

    tenants = {"acme": {"limits": {"tokens_per_minute": 1000}}}
    door, _, cleanup = await keyed_door(tmp_path / "keys.yaml", tenants, Responses())
    try:
        acme = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{door.port}/v1", api_key=KEYS["acme"], max_retries=0)
        await acme.responses.create(model="m", input="hi")  # 4,012 tokens of 1,000: the bucket below zero
        try:
            await acme.responses.create(model="m", input="hi")
            raise AssertionError("a second answer past the tenant's tokens per minute")
        except openai.RateLimitError as refused:
            assert refused.response.json()["error"]["type"] == "tokens"
        counted = door.metrics.registry.get_sample_value
        assert counted("motor_front_door_tenant_tokens_total", {"tenant": "acme", "kind": "completion"}) == 4000
    finally:
        await cleanup()


async def test_a_stream_the_door_does_not_follow_is_charged_an_event_a_token_past_its_ceiling(tmp_path):
    """`stop` strings: the door does not follow the stream's token ids. Named no limit, it was charged
    16 tokens however long it ran."""

    class LongStream(StandIn):
        async def completion(self, request):
            body = await request.json()
            reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await reply.prepare(request)
            event = {"id": "c", "object": "text_completion", "created": 1, "model": body["model"]}
            for _ in range(300):
                choice = {"index": 0, "text": "x", "finish_reason": None}
                await reply.write(b"data: " + json.dumps({**event, "choices": [choice]}).encode() + b"\n\n")
            await reply.write(b"data: [DONE]\n\n")
            await reply.write_eof()
            return reply

    tenants = {"acme": {"limits": {"tokens_per_minute": 1000}}}
    door, _, cleanup = await keyed_door(tmp_path / "keys.yaml", tenants, LongStream())
    try:
        acme = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{door.port}/v1", api_key=KEYS["acme"], max_retries=0)
        stream = await acme.completions.create(model="m", prompt="hi", stop=["zz"], stream=True)
        assert len([chunk async for chunk in stream]) == 300
        counted = door.metrics.registry.get_sample_value
        assert counted("motor_front_door_tenant_tokens_total", {"tenant": "acme", "kind": "completion"}) >= 300
    finally:
        await cleanup()
