"""The runtime LoRA API the controller calls (controller/routing/adapters.py), against the real vLLM CPU
engine: an engine server started with `enable_lora` serves vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter (it sets VLLM_ALLOW_RUNTIME_LORA_UPDATING), a tiny adapter made here
loads without a restart and answers requests by its name, a missing one is refused with vLLM's
answer, and an unloaded one is gone."""

from __future__ import annotations

import json
import urllib.error

import pytest

from tests.support.vllm_engines import NORMAL, start_server, vllm_config

pytestmark = pytest.mark.processes

RANK = 8


def make_adapter(folder, base_model: str, hidden: int = 128, layers: int = 2) -> str:
    """A PEFT LoRA adapter for the tiny Llama (q_proj and v_proj of every layer), random weights."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    torch.manual_seed(0)
    tensors = {}
    for layer in range(layers):
        for module in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, hidden) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(hidden, RANK) * 0.01
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": RANK,
                "lora_alpha": 16,
                "lora_dropout": 0.0,
                "target_modules": ["q_proj", "v_proj"],
                "bias": "none",
                "base_model_name_or_path": base_model,
                "fan_in_fan_out": False,
                "modules_to_save": None,
                "use_rslora": False,
                "use_dora": False,
            }
        )
    )
    return str(folder)


def post(server, path: str, body: dict) -> tuple[int, str]:
    try:
        return 200, server.http(path, body) if path.endswith("completions") else _raw(server, path, body)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _raw(server, path: str, body: dict) -> str:
    import urllib.request

    request = urllib.request.Request(
        server.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read().decode()


def test_an_adapter_loads_serves_and_unloads_at_run_time(tiny_model, vllm_env, tmp_path, request):
    adapter = make_adapter(tmp_path / "adapters" / "sql", tiny_model)
    config = vllm_config(tiny_model, role="union", enable_lora=True, max_lora_rank=RANK, max_loras=2)
    server = start_server(tmp_path, config, vllm_env, request, role="union")
    server.wait_mgmt_up()
    server.status()
    server.wait_status(NORMAL)
    pid = server.process.pid

    # What the controller sends (controller/routing/adapters.py): the same paths and fields.
    status, answer = post(server, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": adapter})
    assert (status, answer) == (200, "Success: LoRA adapter 'sql' added successfully."), answer
    status, body = post(server, "/v1/completions", {"model": "sql", "prompt": "1", "max_tokens": 2})
    assert status == 200 and body["model"] == "sql", body
    models = [m["id"] for m in json.loads(server.http("/v1/models"))["data"]]
    assert "sql" in models
    status, answer = post(server, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": adapter})
    assert status == 400 and "has already been loaded" in answer  # what a controller restart meets: loaded
    missing = str(tmp_path / "adapters" / "missing")
    status, answer = post(server, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": missing})
    assert status == 404 and "No adapter found" in answer, answer
    status, answer = post(server, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert status == 200, answer
    status, answer = post(server, "/v1/completions", {"model": "sql", "prompt": "1", "max_tokens": 2})
    assert status == 404 and "does not exist" in answer, answer
    status, answer = post(server, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert status == 404 and "cannot be found" in answer
    assert server.process.pid == pid and server.process.poll() is None  # never restarted
