"""The simulated engine streams as engines do, with token ids: an answer continued from its
prompt's ids and the ids already sent is exactly the rest of the uninterrupted answer (what the
front door relies on to repair a stream cut by its engine's death), vLLM's return_token_ids,
logprobs and include_usage fields, a character split over two tokens, and tokens over time."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from engine_server.engines import sim_tokens
from engine_server.engines.sim_request import render_chat
from engine_server.engines.sim_tokens import SPLIT_FIRST, SPLIT_SECOND, deterministic_text, generate, tokenize
from tests.support.sim_streams import answer, events, sim_session, streamed_tokens

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me a story"}]
LENGTH = 260


def test_the_model_continues_itself_token_exactly():
    prompt_ids = tokenize("once upon a time")
    ids = generate(prompt_ids, LENGTH)
    whole = sim_tokens.pieces(prompt_ids, ids)
    assert SPLIT_FIRST in ids and all(0 <= i < len(sim_tokens.PIECES) for i in ids)
    for k in range(1, LENGTH):
        assert generate(prompt_ids + ids[:k], LENGTH - k) == ids[k:]
        assert sim_tokens.pieces(prompt_ids + ids[:k], ids[k:]) == whole[k:]
    assert "".join(whole) == deterministic_text("once upon a time", LENGTH)
    assert tokenize("motor café zebra") == [0, SPLIT_FIRST, SPLIT_SECOND, tokenize("zebra")[0]]
    assert tokenize("zebra")[0] >= sim_tokens.OOV_BASE  # a stable id (crc32), not hash()'s salted one


@pytest.mark.parametrize("chat", [False, True])
async def test_an_answer_continued_from_the_ids_sent_is_the_rest(chat):
    async with sim_session() as (_, session):
        if chat:
            path, body = "/v1/chat/completions", {"messages": CHAT, "max_tokens": LENGTH, "return_token_ids": True}
        else:
            path = "/v1/completions"
            body = {"prompt": "tell me a story", "max_tokens": LENGTH, "return_token_ids": True}
        chunks = await events(session, path, body)
        first = chunks[0][1]
        prompt_ids = first["prompt_token_ids"] if chat else first["choices"][0]["prompt_token_ids"]
        assert prompt_ids == tokenize(render_chat(CHAT) if chat else "tell me a story")
        ids, texts = streamed_tokens(chunks)
        assert ids == generate(prompt_ids, LENGTH) and len(texts) == LENGTH
        for k in (1, 50, 200):
            rest = {"prompt": prompt_ids + ids[:k], "max_tokens": LENGTH - k, "return_token_ids": True}
            whole = await answer(session, "/v1/completions", rest)
            assert whole["choices"][0]["token_ids"] == ids[k:]
            assert whole["choices"][0]["text"] == "".join(texts[k:])
            assert whole["usage"]["prompt_tokens"] == len(prompt_ids) + k
            streamed_ids, streamed_texts = streamed_tokens(await events(session, "/v1/completions", rest))
            assert streamed_ids == ids[k:] and streamed_texts == texts[k:]


def split_prompt() -> tuple[str, int]:
    """A prompt whose answer has the split word early, and where its first half is."""
    for n in range(1000):
        prompt = f"split word {n}"
        ids = generate(tokenize(prompt), 20)
        if SPLIT_FIRST in ids[1:]:
            return prompt, ids.index(SPLIT_FIRST, 1)
    raise AssertionError("no answer with the split word")


async def test_a_character_split_over_two_tokens_comes_whole_with_the_second():
    prompt, at = split_prompt()
    async with sim_session() as (_, session):
        body = {"prompt": prompt, "max_tokens": at + 3, "return_token_ids": True}
        ids, texts = streamed_tokens(await events(session, "/v1/completions", body))
        assert ids[at : at + 2] == [SPLIT_FIRST, SPLIT_SECOND]
        assert texts[at] == "" and texts[at + 1] == " café"  # held back, then the whole character
        cut = {"prompt": tokenize(prompt) + ids[: at + 1], "max_tokens": 2, "return_token_ids": True}
        rest_ids, rest_texts = streamed_tokens(await events(session, "/v1/completions", cut))
        assert rest_ids == ids[at + 1 :] and rest_texts == texts[at + 1 :]
        assert ("".join(texts[: at + 1]) + "".join(rest_texts)).count("é") == 1
        chat_stream = await events(session, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3})
        assert all("token_ids" not in c["choices"][0] for _, c in chat_stream[:-1])
        cut_at_end = await answer(session, "/v1/completions", {"prompt": prompt, "max_tokens": at + 1})
        assert cut_at_end["choices"][0]["text"] == "".join(texts[:at])  # an incomplete character is not sent


async def test_return_token_ids_and_usage_have_vllms_shapes():
    async with sim_session() as (_, session):
        ids = generate(tokenize("a b c"), 3)
        body = {"prompt": "a b c", "max_tokens": 3, "return_token_ids": True, "stream_options": {"include_usage": True}}
        chunks = [c for _, c in await events(session, "/v1/completions", body)]
        assert chunks[-1] == "[DONE]"
        assert chunks[-2]["choices"] == [] and chunks[-2]["usage"] == {
            "prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}  # fmt: skip
        choices = [c["choices"][0] for c in chunks[:3]]
        assert [c["prompt_token_ids"] for c in choices] == [tokenize("a b c"), None, None]
        assert [c["token_ids"] for c in choices] == [[i] for i in ids]
        assert [c["finish_reason"] for c in choices] == [None, None, "length"]
        assert all("usage" not in c for c in chunks[:3])

        plain = [c for _, c in await events(session, "/v1/completions", {"prompt": "a b c", "max_tokens": 3})]
        assert len(plain) == 4 and plain[-1] == "[DONE]"  # no usage chunk without include_usage
        assert all(set(c["choices"][0]) & {"token_ids", "prompt_token_ids"} == set() and "usage" not in c
                   for c in plain[:-1])  # fmt: skip

        chat = {"messages": CHAT, "max_tokens": 3, "return_token_ids": True, "stream_options": {"include_usage": True}}
        chunks = [c for _, c in await events(session, "/v1/chat/completions", chat)]
        prompt_ids = tokenize(render_chat(CHAT))
        assert chunks[0]["prompt_token_ids"] == prompt_ids and chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert [c["choices"][0]["token_ids"] for c in chunks[1:4]] == [[i] for i in generate(prompt_ids, 3)]
        assert all("prompt_token_ids" not in c for c in chunks[1:])
        assert chunks[4]["usage"]["prompt_tokens"] == len(prompt_ids) and chunks[4]["choices"] == []

        whole = await answer(session, "/v1/completions", {"prompt": "a b c", "max_tokens": 3, "return_token_ids": True})
        assert whole["choices"][0]["prompt_token_ids"] == tokenize("a b c") and whole["choices"][0]["token_ids"] == ids
        assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
        whole = await answer(session, "/v1/chat/completions", {**chat, "stream": False})
        assert whole["prompt_token_ids"] == prompt_ids and whole["choices"][0]["token_ids"] == generate(prompt_ids, 3)
        assert "prompt_token_ids" not in whole["choices"][0]
        whole = await answer(session, "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 2})
        assert "prompt_token_ids" not in whole and "token_ids" not in whole["choices"][0]
        assert whole["usage"]["completion_tokens"] == 2


async def test_a_prompt_of_token_ids_is_the_same_prompt():
    async with sim_session() as (_, session):
        text = await answer(session, "/v1/completions", {"prompt": "hello motor world", "max_tokens": 5})
        ids = await answer(session, "/v1/completions", {"prompt": tokenize("hello motor world"), "max_tokens": 5})
        assert ids["choices"][0]["text"] == text["choices"][0]["text"] == deterministic_text("hello motor world", 5)
        assert ids["usage"] == text["usage"] and ids["usage"]["prompt_tokens"] == 3
        accepted = {"ignore_eos": True, "temperature": 0.7, "seed": 3, "stop": ["\n"]}
        same = await answer(session, "/v1/completions", {"prompt": "hello motor world", "max_tokens": 5, **accepted})
        assert same["choices"][0]["text"] == text["choices"][0]["text"]  # greedy, whatever the sampling
        for bad in ([-1], [sim_tokens.VOCAB_SIZE], [], [1, "x"], [True]):
            async with session.post("/v1/completions", json={"prompt": bad}) as response:
                assert response.status == 400, bad


async def test_logprobs_have_vllms_shapes():
    async with sim_session() as (_, session):
        whole = await answer(session, "/v1/completions", {"prompt": "p q", "max_tokens": 4, "logprobs": 2})
        logprobs = whole["choices"][0]["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 4
        assert logprobs["text_offset"][0] == 0 and all(len(top) == 3 for top in logprobs["top_logprobs"])
        steps = zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True)
        assert all(top[token] == logprob for token, logprob, top in steps)
        chunks = await events(session, "/v1/completions", {"prompt": "p q", "max_tokens": 4, "logprobs": 2})
        assert [c["choices"][0]["logprobs"]["tokens"][0] for _, c in chunks[:-1]] == logprobs["tokens"]
        assert [c["choices"][0]["logprobs"]["text_offset"][0] for _, c in chunks[:-1]] == logprobs["text_offset"]
        chat = {"messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
        content = (await answer(session, "/v1/chat/completions", chat))["choices"][0]["logprobs"]["content"]
        assert len(content) == 4 and all(len(step["top_logprobs"]) == 2 for step in content)
        assert all(step["bytes"] == list(step["token"].encode()) for step in content)
        assert all(step["top_logprobs"][0]["logprob"] == step["logprob"] for step in content)
        plain = await answer(session, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})
        assert plain["choices"][0]["logprobs"] is None


async def test_decode_ms_per_token_streams_a_token_at_a_time():
    async with sim_session(decode_ms_per_token=25.0) as (engine, session):
        progress = engine.progress()
        started = time.monotonic()
        chunks = await events(session, "/v1/completions", {"prompt": "slow", "max_tokens": 40})
        assert len(chunks) == 41 and chunks[-1][1] == "[DONE]"
        first, last = chunks[0][0], chunks[-2][0]
        assert last - first >= 0.5, "the tokens came at once"  # 39 intervals of 25 ms
        assert first - started < 0.5 * (last - started)
        assert engine.progress() - progress >= 40
        started = time.monotonic()
        whole = await answer(session, "/v1/completions", {"prompt": "slow", "max_tokens": 40})
        assert time.monotonic() - started >= 0.5 and whole["choices"][0]["text"] == deterministic_text("slow", 40)

        async def watch_progress() -> list[int]:
            seen = []
            for _ in range(10):
                await asyncio.sleep(0.1)
                seen.append(engine.progress())
            return seen

        watcher = asyncio.create_task(watch_progress())
        await answer(session, "/v1/completions", {"prompt": "slow", "max_tokens": 60})
        seen = await watcher
        assert len(set(seen)) >= 5, seen  # it moves as each token is made: never read as hung


async def test_a_stream_cut_by_the_engine_ends_without_done():
    async with sim_session(decode_ms_per_token=20.0) as (engine, session):
        received: list[bytes] = []

        async def read() -> None:
            async with session.post("/v1/completions", json={"prompt": "x", "max_tokens": 1000, "stream": True}) as r:
                async for line in r.content:
                    received.append(line)

        reader = asyncio.create_task(read())
        while len(received) < 10:
            await asyncio.sleep(0.01)
        await engine.shutdown()
        try:
            await asyncio.wait_for(reader, 5)
        except aiohttp.ClientPayloadError:
            pass
        assert received and not any(b"[DONE]" in line for line in received)
