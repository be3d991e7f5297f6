"""A stream that survives its engine: two real vLLM CPU engines of the tiny model behind
`motorctl up`'s front door, a greedy streamed answer of 400 tokens, and the engine server serving
it SIGKILLed after K chunks. The door continues the answer on the other engine (a completion of the
prompt's ids and the ids already sent): the client reads one uninterrupted stream, the same id,
text (and token ids, where it asked for them) equal to the uninterrupted reference token for token,
the reference's usage and finish_reason, `data: [DONE]`, no error event; token ids it did not ask
for never reach it. The killed engine is replaced by Motor before the next case.

Before the door continues streams (front_door/streams.py), a cut stream ends with an OpenAI error
event and no [DONE]: these tests fail on that."""

from __future__ import annotations

import os
import signal

import pytest

from tests.support import wait_for
from tests.support.sse_stream import Streamed, stream
from tests.support.stream_faults import all_routed, door_series, engines, routed_to, router_decisions, total
from tests.support.vllm_engines import vllm_cluster, vllm_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOKENS = 400
KILL_AFTER = 3  # chunks read before the SIGKILL: begun, most of it still to come (400 tokens take < 1 s)
CONTINUED = "motor_front_door_continuations_total"
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": TOKENS, "stream_options": {"include_usage": True}}
COMPLETION = ("/v1/completions", {"prompt": "Motor is a control plane for", **GREEDY})
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a long story."}], **GREEDY})
CASES = {
    "completion": (*COMPLETION, False),
    "completion-token-ids": (COMPLETION[0], {**COMPLETION[1], "return_token_ids": True}, True),
    "chat": (*CHAT, False),
}


@pytest.fixture(scope="module")
def door(tiny_model, vllm_env, tmp_path_factory):
    model = os.path.basename(tiny_model)
    # Room for the prompt and 400 tokens (the tiny model's positions: 512; longer, greedy answers
    # continued from a prefill depart from uninterrupted ones: prefill and decode round apart); no virtual inference,
    # whose probes would count in the engines' in-flight requests.
    section = vllm_config(
        tiny_model, health={"enable_virtual_inference": False}, served_model_name=model, max_model_len=512
    )["motor_engine_prefill_config"]
    with vllm_cluster(
        tiny_model,
        vllm_env,
        str(tmp_path_factory.mktemp("vllm-continue")),
        section,
        lambda local, stub: all_routed(local, stub, 2),
        node_id_prefix="vcont",
        engine_port_base=38900,
        engines=2,
        router=True,
    ) as (local, stub):
        yield local, stub, model


@pytest.fixture(scope="module")
def references(door) -> dict[str, Streamed]:
    """Each case's answer uninterrupted (greedy: the answer any engine gives), read once."""
    local, _, model = door
    answers = {}
    for name, (path, body, _) in CASES.items():
        answers[name] = stream(local.router_url, path, {**body, "model": model})
        assert answers[name].done and not answers[name].errors, answers[name].events[-3:]
    return answers


def first_difference(a: list, b: list) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"at {at} of {len(a)}/{len(b)}: {a[max(0, at - 3) : at + 3]!r} != {b[max(0, at - 3) : at + 3]!r}"


def prompt_ids(streamed: Streamed) -> list[list[int]]:
    """Each `prompt_token_ids` the stream carried (vLLM puts a completion's in its choice, a chat
    completion's at the chunk's top)."""
    found = [c["prompt_token_ids"] for c in streamed.chunks if c.get("prompt_token_ids")]
    return found + [
        choice["prompt_token_ids"]
        for c in streamed.chunks
        for choice in c.get("choices") or []
        if choice.get("prompt_token_ids")
    ]


@pytest.mark.parametrize("case", list(CASES))
def test_a_stream_whose_engine_server_is_sigkilled_goes_on_token_for_token_on_the_other_engine(door, references, case):
    local, stub, model = door
    path, body, asked_ids = CASES[case]
    reference = references[case]
    assert len(reference.texts()) >= TOKENS // 2, "the reference is too short to be cut"
    all_routed(local, stub, 2)  # the engine killed by the previous case replaced
    before = total(door_series(local.router_url, CONTINUED), CONTINUED)
    killed: list = []

    serving: list = []
    decided = router_decisions(local)

    def kill_after(index: int, event: object) -> None:
        # The engine serving it: the one the router sent it to (found at its first event: the tiny
        # model makes the whole answer within a second, too soon for an in-flight count to show).
        if index == 0 and not serving:
            serving.append(routed_to(local, stub, decided))
        if index == KILL_AFTER and not killed:
            os.kill(serving[0].pid, signal.SIGKILL)
            killed.append(serving[0])

    got = stream(local.router_url, path, {**body, "model": model}, on_event=kill_after, timeout=180)
    assert killed, f"the stream ended after {len(got.events)} events, before the kill: {got.events[-2:]}"
    victim = killed[0]
    assert not got.errors, f"the stream was cut: {got.errors} after {len(got.chunks)} chunks"
    assert not got.broken, got.broken
    assert got.done, f"no [DONE]: the last events {got.events[-2:]}"
    assert len({(c["id"], c["created"], c["object"]) for c in got.chunks}) == 1, "one stream: one id, created, object"
    assert got.chunks[0]["object"] == reference.chunks[0]["object"]
    assert got.text == reference.text, first_difference(reference.texts(), got.texts())
    if asked_ids:
        assert got.token_ids == reference.token_ids, first_difference(reference.token_ids, got.token_ids)
        assert len(got.token_ids) == TOKENS
        assert prompt_ids(got) == prompt_ids(reference) and len(prompt_ids(got)) == 1, "the prompt's ids, once"
    else:
        assert got.fields("token_ids") == [] and got.fields("prompt_token_ids") == [], (
            "token ids the client never asked for"
        )
    assert got.usage is not None and reference.usage is not None
    assert (
        (got.usage["prompt_tokens"], got.usage["completion_tokens"])
        == (
            reference.usage["prompt_tokens"],
            reference.usage["completion_tokens"],
        )
        == (reference.usage["prompt_tokens"], TOKENS)
    )
    assert got.finish_reasons == ["length"]
    gap = max(got.gaps()[KILL_AFTER - 1 :])
    print(f"{case}: continued after the SIGKILL of pid {victim.pid}; longest gap {gap:.2f} s")
    after = door_series(local.router_url, CONTINUED)
    assert total(after, CONTINUED) >= before + 1, f"no continuation counted: {after}"

    def replaced():
        pids = {e.pid for e in engines(stub)}
        return victim.pid not in pids and len(pids) == 2

    wait_for(replaced, timeout=300, interval=1, what="the killed engine replaced")


def test_vllm_starts_a_continuation_with_the_prompts_text_where_the_ids_sent_end_mid_character(door, references):
    """What a continuation meets in vLLM 0.32 (straight to an engine, no door): the tiny model's
    byte-level tokens often end a chunk inside a UTF-8 character, and vLLM holds that chunk's text
    back (its `token_ids`, empty `text`). A completion whose prompt ids end there does go on token
    for token, but its first text is the whole prompt's text and what was held: vLLM primes its
    detokenizer with the prompt ids (vllm/v1/engine/detokenizer.py, FastIncrementalDetokenizer:
    `DecodeStream(ids=request.prompt_token_ids)`), and tokenizers' DecodeStream, primed with ids
    ending in an incomplete character, returns the whole decoded prefix at its first step. A door
    continuing a stream cut there must not write that text on (for a chat, it is the rendered
    template); pinned here so that a vLLM which stops doing so is noticed."""
    local, stub, model = door
    reference = references["completion-token-ids"]
    held = [i for i, c in enumerate(reference.chunks[:-1]) if c["choices"] and c["choices"][0].get("token_ids")]
    held = [i for i in held if not reference.chunks[i]["choices"][0]["text"]]
    assert held, "no chunk of the reference ends inside a character"
    cut = held[0] + 1  # the stream cut right after a chunk whose text was held
    sent = [t for c in reference.chunks[:cut] for choice in c["choices"] for t in choice.get("token_ids") or []]
    sent_text = "".join(reference.texts()[:cut])
    engine = all_routed(local, stub, 2)[0].url
    continuation = stream(
        engine,
        "/v1/completions",
        {
            **GREEDY,
            "model": model,
            "prompt": prompt_ids(reference)[0] + sent,
            "max_tokens": TOKENS - len(sent),
            "return_token_ids": True,
        },
    )
    assert continuation.done and continuation.token_ids == reference.token_ids[len(sent) :]
    first = next(t for t in continuation.texts() if t)
    assert first.startswith(COMPLETION[1]["prompt"]), first[:80]
    assert sent_text + continuation.text != reference.text
