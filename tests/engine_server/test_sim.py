"""The simulated engine's HTTP API, in-process on a free port."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from engine_server.engines import sim as sim_module
from engine_server.engines.base import EngineOptions
from engine_server.engines.sim import SimEngine
from engine_server.engines.sim_metrics import SIM_KV_LEGS
from engine_server.engines.sim_tokens import deterministic_text, tokenize
from engine_server.probing import probe_request
from motor.ports import free_port


@pytest.fixture
async def sim():
    port = free_port()
    engine = SimEngine(
        EngineOptions(role="union", instance_id="u", dp_rank=0, host="127.0.0.1", port=port, master_dp_ip="127.0.0.1",
                      engine_args={"model": "tiny", "utilization": 7})
    )  # fmt: skip
    await engine.start()
    async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as session:
        yield engine, session
    await engine.shutdown()


async def post(session, path, body, **kwargs):
    async with session.post(path, json=body, **kwargs) as response:
        return response.status, await response.json(content_type=None)


async def test_answers_are_deterministic_and_openai_shaped(sim):
    engine, session = sim
    status, first = await post(session, "/v1/completions", {"prompt": "the same prompt", "max_tokens": 6})
    assert status == 200
    _, again = await post(session, "/v1/completions", {"prompt": "the same prompt", "max_tokens": 6})
    _, other = await post(session, "/v1/completions", {"prompt": "another prompt", "max_tokens": 6})
    text = first["choices"][0]["text"]
    assert text == deterministic_text("the same prompt", 6)  # 6 tokens: the split word "café" is two
    assert text == again["choices"][0]["text"] != other["choices"][0]["text"]
    assert first["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert first["model"] == "tiny" and first["object"] == "text_completion"
    status, chat = await post(session, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and chat["choices"][0]["message"]["role"] == "assistant"
    async with session.get("/v1/models") as response:
        assert (await response.json())["data"][0]["id"] == "tiny"


async def test_streaming_gives_the_same_text(sim):
    _, session = sim
    _, whole = await post(session, "/v1/completions", {"prompt": "stream me", "max_tokens": 4})
    async with session.post(
        "/v1/completions", json={"prompt": "stream me", "max_tokens": 4, "stream": True}
    ) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in (await response.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    pieces = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
    assert "".join(pieces) == whole["choices"][0]["text"]


@pytest.mark.parametrize(
    "path, body, expected",
    [
        ("/v1/completions", {"max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/completions", [1, 2], "JSON object"),
    ],
)
async def test_bad_requests_get_400_naming_the_problem(sim, path, body, expected):
    _, session = sim
    status, answer = await post(session, path, body)
    assert status == 400 and expected in answer["error"]["message"]


async def test_faults_at_run_time(sim):
    engine, session = sim
    status, answer = await post(session, "/sim/faults", {"fail_inference": True, "utilization": 90})
    assert status == 200 and answer["fail_inference"] and answer["utilization"] == 90
    assert await engine.utilization_sampler().sample() == 90
    status, _ = await post(session, "/v1/completions", {"prompt": "x"})
    assert status == 500
    async with session.get("/health") as response:
        assert response.status == 200  # /health stays green while inference fails
    async with session.delete("/sim/faults") as response:
        assert (await response.json())["fail_inference"] is False
    assert await engine.utilization_sampler().sample() == 7  # back to the config's figure
    status, answer = await post(session, "/sim/faults", {"fail_inferense": True})
    assert status == 400 and "faults.fail_inferense" in answer["error"]["message"]
    status, answer = await post(session, "/sim/faults", {"utilization": 101})
    assert status == 400 and "faults.utilization" in answer["error"]["message"]
    async with session.get("/sim/faults") as response:
        assert (await response.json())["utilization"] == 7  # a rejected change changes nothing


async def test_crash_fault_makes_wait_dead_return(sim):
    engine, session = sim
    await post(session, "/sim/faults", {"crash": True})
    assert await engine.wait_dead() == "sim fault: crash"


async def test_in_flight_requests_exclude_probes(sim, monkeypatch):
    """Each request records the in-flight count while it is being answered: a probe alone must see
    0, a real request alone 1 (so counting the probe instead of the request fails too)."""
    engine, session = sim
    seen: dict[str, int] = {}

    class RecordingModel(sim_module.Model):
        def __init__(self, prompt_ids):
            seen[{tuple(tokenize("probe")): "probe", tuple(tokenize("real")): "real"}[tuple(prompt_ids)]] = (
                engine.in_flight_requests()
            )
            super().__init__(prompt_ids)

    monkeypatch.setattr(sim_module, "Model", RecordingModel)
    status, _ = await post(session, "/v1/completions", {"prompt": "probe", "max_tokens": 1},
                           headers=probe_request("prefill")[1])  # fmt: skip
    assert status == 200 and seen == {"probe": 0}
    status, _ = await post(session, "/v1/completions", {"prompt": "real", "max_tokens": 1})
    assert status == 200 and seen == {"probe": 0, "real": 1}
    assert engine.in_flight_requests() == 0


async def test_a_request_for_another_model_gets_vllms_404(sim):
    """Routers route by the request's `model`: like vLLM, the engine answers only its own model
    (or none named) and refuses another with vLLM's 404 body, naming the model it serves."""
    engine, session = sim
    status, body = await post(session, "/v1/completions", {"model": "llama-70b", "prompt": "hi", "max_tokens": 2})
    assert status == 404
    assert body == {
        "error": {
            "message": "The model `llama-70b` does not exist. Valid aliases: tiny.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    status, _ = await post(
        session, "/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "x"}]}
    )
    assert status == 404
    status, body = await post(session, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert status == 200 and body["model"] == "tiny"


async def test_lora_adapters_load_and_unload_at_run_time_as_with_vllm(sim, tmp_path):
    """vLLM's runtime LoRA API (VLLM_ALLOW_RUNTIME_LORA_UPDATING), emulated: an adapter folder
    loads under its name, requests may name it, it unloads; vLLM's refusals, codes and bodies."""
    engine, session = sim
    adapter = tmp_path / "sql-lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8, "peft_type": "LORA"}')
    status, body = await post(session, "/v1/completions", {"model": "sql", "prompt": "hi", "max_tokens": 2})
    assert status == 404
    async with session.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapter)}) as reply:
        assert reply.status == 200 and await reply.text() == "Success: LoRA adapter 'sql' added successfully."
    status, body = await post(session, "/v1/completions", {"model": "sql", "prompt": "hi", "max_tokens": 2})
    assert status == 200 and body["model"] == "sql"
    async with session.get("/v1/models") as response:
        assert [m["id"] for m in (await response.json())["data"]] == ["tiny", "sql"]
    status, body = await post(session, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(adapter)})
    assert status == 400 and "has already been loaded" in body["error"]["message"]
    status, body = await post(session, "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": str(adapter)})
    assert status == 400 and body["error"]["message"] == "The lora adapter 'tiny' conflicts with a served base model."
    status, body = await post(session, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "none")})
    assert (
        status == 404 and body["error"]["message"] == f"Loading lora x failed: No adapter found for {tmp_path / 'none'}"
    )
    async with session.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}) as reply:
        assert reply.status == 200
    status, body = await post(session, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert status == 404 and body["error"]["message"] == "The lora adapter 'sql' cannot be found."
    status, _ = await post(session, "/v1/completions", {"model": "sql", "prompt": "hi", "max_tokens": 2})
    assert status == 404


async def test_hang_inference_freezes_completions_only(sim):
    """The failure seen in vLLM fleets: completions never answer while /health stays 200 and the
    utilization figure stays where it was."""
    engine, session = sim
    await post(session, "/sim/faults", {"utilization": 90})
    status, answer = await post(session, "/sim/faults", {"hang_inference": True})
    assert status == 200 and answer["hang_inference"] is True and answer["hang"] is False
    stuck = asyncio.ensure_future(post(session, "/v1/completions", {"prompt": "x"}))
    probe = asyncio.ensure_future(post(session, "/v1/completions", {"prompt": "p", "max_tokens": 1},
                                       headers=probe_request("prefill")[1]))  # fmt: skip
    done, _ = await asyncio.wait([stuck, probe], timeout=0.5)
    assert not done  # neither a request nor a probe answers
    async with session.get("/health") as response:
        assert response.status == 200
    assert await engine.utilization_sampler().sample() == 90
    await post(session, "/sim/faults", {"hang_inference": False})
    (status, _), (probe_status, _) = await asyncio.wait_for(asyncio.gather(stuck, probe), 5)
    assert status == 200 and probe_status == 200  # released where they waited


def kv_legs(leg: str) -> float:
    return SIM_KV_LEGS.labels("tiny", leg)._value.get()


async def test_the_prefill_decode_flow_of_a_disaggregating_router(sim):
    """As vllm-router sends it in P/D mode: the prefill leg (max_tokens 1) answers where its KV cache
    is; the decode leg carries that answer, skips the prefill and generates."""
    engine, session = sim
    engine.args.prefill_ms_per_token = 100.0  # 3 prompt words: 0.3 s to prefill
    before = kv_legs("prefill"), kv_legs("decode")
    prefill_leg = {
        "prompt": "a long prompt",
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None},
    }
    started = asyncio.get_running_loop().time()
    status, first = await post(session, "/v1/completions", prefill_leg)
    prefill_time = asyncio.get_running_loop().time() - started
    assert status == 200, first
    handoff = first["kv_transfer_params"]
    assert handoff["do_remote_prefill"] is True and handoff["remote_engine_id"] == "u/rank0"
    assert handoff["remote_host"] == "127.0.0.1" and handoff["remote_port"] == engine.options.port
    assert handoff["remote_block_ids"]
    started = asyncio.get_running_loop().time()
    status, second = await post(
        session, "/v1/completions", {"prompt": "a long prompt", "max_tokens": 4, "kv_transfer_params": handoff}
    )
    decode_time = asyncio.get_running_loop().time() - started
    assert status == 200, second
    assert second["choices"][0]["text"] == deterministic_text("a long prompt", 4) and "kv_transfer_params" not in second
    assert prefill_time >= 0.25 > decode_time  # the decode leg fetched the KV cache: no prefill
    assert (kv_legs("prefill"), kv_legs("decode")) == (before[0] + 1, before[1] + 1)


async def test_a_decode_leg_without_its_handoff_is_refused_naming_what_is_missing(sim):
    _, session = sim
    status, body = await post(
        session,
        "/v1/completions",
        {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "p/rank0"}},
    )
    assert status == 400
    assert "remote_block_ids, remote_host, remote_port" in body["error"]["message"]


async def test_the_decode_probe_is_a_whole_request(sim):
    """The engine server's decode probe sends `do_virtual` and asks for neither leg."""
    _, session = sim
    body, headers = probe_request("decode")
    status, answer = await post(session, "/v1/completions", body, headers=headers)
    assert status == 200 and "kv_transfer_params" not in answer
