"""A controller started with --kv-events asks every engine for its KV cache events and lists where
each one publishes them with its endpoint, with its tokenizer and generation (what a front door's
KV routing follows: docs/router.md, "KV routing"); without it, nothing of the sort."""

from __future__ import annotations

import json

from controller.routing.endpoints import tokenizer_of
from tests.support.controller_harness import Harness, running_example


async def test_with_kv_events_each_endpoint_names_where_its_engine_publishes_them(tmp_path):
    h = Harness(tmp_path, kv_events=True)
    try:
        await running_example(h)
        starts = [spec for call, _, spec in h.client.calls if call == "start"]
        assert starts and all(spec.kv_events for spec in starts)
        listed = h.controller.list_endpoints()
        assert len(listed) == 3
        for endpoint in listed:
            engine = next(
                e for node in h.client.engines.values() for key, e in node.items() if key == endpoint.engine_id
            )
            host = endpoint.url.removeprefix("http://").rpartition(":")[0]
            assert endpoint.kv_events == f"tcp://{host}:{engine.spec.kv_events_port}" and engine.spec.kv_events_port
            assert endpoint.tokenizer == "sim" and endpoint.generation == engine.spec.generation >= 1
    finally:
        await h.stop()


async def test_without_kv_events_no_engine_is_asked_for_them(harness):
    await running_example(harness)
    assert not any(spec.kv_events for call, _, spec in harness.client.calls if call == "start")
    assert [(e.kv_events, e.tokenizer) for e in harness.controller.list_endpoints()] == [("", "")] * 3


def test_the_tokenizer_is_the_simulated_engines_or_the_models():
    def config(engine_type: str, **args) -> str:
        return json.dumps({"motor_engine_union_config": {"engine_type": engine_type, "engine_args": args}})

    assert tokenizer_of(config("sim", model="sim-tiny")) == "sim"
    assert tokenizer_of(config("vllm", model="/models/llama")) == "/models/llama"
    assert tokenizer_of(config("vllm", model="/models/llama", tokenizer="/models/tok")) == "/models/tok"
    assert tokenizer_of("not json") == tokenizer_of("{}") == ""
