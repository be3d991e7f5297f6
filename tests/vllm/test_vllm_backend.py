"""The vLLM backend's parts that run without starting vLLM: argument checks (they import vLLM's
parser and read the tiny model's config), probe-id matching, the patch guard, the CPU build's
progress sampler."""

from __future__ import annotations

import json
import subprocess

import pytest

from engine_server.engines.base import probe_request_id
from engine_server.engines.vllm_probe_filter import (
    VllmPatchError,
    _check,
    is_probe_external_id,
    is_probe_internal_id,
)
from engine_server.engines.vllm_utilization import EngineProgress, EngineProgressSampler
from motor.contract.termination import read_termination_message
from motor.errors import ConfigError
from motorctl.tiny_model import LEAN_CPU_ARGS
from tests.support.vllm_engines import ENGINE_SERVER, vllm_config

FIELD = "motor_engine_prefill_config.engine_args"


def test_only_this_engine_servers_probe_ids_are_probes():
    probe = probe_request_id(1795313754871)  # what the prober sends
    assert is_probe_external_id(probe)
    assert is_probe_external_id(f"cmpl-{probe}-0")  # vLLM: completion, prompt index 0
    assert is_probe_external_id(f"cmpl-{probe}-12")
    assert is_probe_external_id(f"chatcmpl-{probe}")
    assert is_probe_internal_id(f"cmpl-{probe}-0-1a2b3c4d")  # engine core: plus a random suffix
    assert is_probe_internal_id(f"chatcmpl-{probe}-1a2b3c4d")
    assert not is_probe_internal_id(f"cmpl-{probe}")  # the suffix is missing: not internal
    # Ids a client may choose: counted, however much they look like a probe's.
    for client_id in (
        "1795313754871_virtual", "cmpl-1795313754871_virtual-0", "order_virtual", "cmpl-order_virtual-0",
        "1795313754871-0123456789abcdef_virtual", probe.replace("_virtual", "_virtualx"), "", None,
    ):  # fmt: skip
        assert not is_probe_external_id(client_id), client_id
    assert not is_probe_internal_id("cmpl-1795313754871_virtual-0-1a2b3c4d")


def test_a_missing_or_changed_vllm_method_fails_loudly():
    class Drifted:
        def _update_stats_from_finished(self, req_state, reason, stats):  # renamed parameter
            pass

    with pytest.raises(VllmPatchError, match="_update_stats_from_output is missing"):
        _check(Drifted, "_update_stats_from_output", ["self", "req_state"])
    with pytest.raises(VllmPatchError, match="expected"):
        _check(Drifted, "_update_stats_from_finished", ["self", "req_state", "finish_reason", "iteration_stats"])


def test_progress_sampler_reads_busy_only_when_tokens_were_produced_since_the_last_reading():
    progress = EngineProgress()
    sampler = EngineProgressSampler(progress)
    assert sampler.read() == 0.0  # idle (or hung): nothing produced
    progress.add(3)
    assert sampler.read() == 100.0
    assert sampler.read() == 0.0  # nothing since the previous reading
    progress.step()  # a step with no client request in the engine (a probe's): no progress
    assert sampler.read() == 0.0
    progress.serving_clients = lambda: True
    progress.step()  # a prefill chunk of a client request: no token yet, but the engine core moved
    assert sampler.read() == 100.0 and progress.total == 4


@pytest.fixture(scope="module")
def check(tiny_model):
    from engine_server.engines.vllm_engine import VllmEngine

    def run(**overrides):
        engine_args = {"model": tiny_model, **LEAN_CPU_ARGS, **overrides}
        return VllmEngine.check_args({k: v for k, v in engine_args.items() if v is not None}, FIELD)

    return run


@pytest.mark.vllm
def test_valid_engine_args_pass(check):
    assert check(motor_utilization=50, served_model_name=["tiny", "tiny-alias"], enable_prefix_caching=False)


@pytest.mark.vllm
def test_the_kv_events_port_is_a_kv_events_config_vllm_takes(check):
    from engine_server.kv_events_args import with_kv_events

    assert check(**with_kv_events("vllm", {}, 5600, 0))


@pytest.mark.vllm
@pytest.mark.parametrize(
    "overrides, field, words",
    [
        ({"max_model_length": 256}, "max_model_length", "not a vLLM argument"),
        ({"max_model_len": "abc"}, "max_model_len", "invalid"),
        ({"dtype": "float13"}, "dtype", "invalid choice"),
        ({"enforce_eager": "yes"}, "enforce_eager", "true or false"),
        ({"port": 9000}, "port", "--port"),
        ({"host": "0.0.0.0"}, "host", "--host"),
        ({"motor_utilization": 150}, "motor_utilization", "0 to 100"),
        ({"motor_utilization": True}, "motor_utilization", "0 to 100"),
        ({"model": "/nonexistent/model"}, "model", "no such model folder"),
        ({"model": None}, "model", "required"),
        ({"max_model_len": 1_000_000}, "", "vLLM rejected the configuration"),
        ({"distributed_executor_backend": "ray"}, "distributed_executor_backend", "Ray is not supported"),
        ({"data_parallel_backend": "ray"}, "data_parallel_backend", "use mp"),
        (
            {"ssl_certfile": "/tmp/cert.pem", "ssl_keyfile": "/tmp/key.pem"},
            "ssl_certfile",
            "TLS on the inference plane is not supported",
        ),
    ],
)
def test_bad_engine_args_are_named(check, overrides, field, words):
    with pytest.raises(ConfigError) as raised:
        check(**overrides)
    message = str(raised.value)
    assert message.startswith(f"{FIELD}.{field}:" if field else f"{FIELD}:"), message
    assert words in message, message


@pytest.mark.vllm
def test_engine_server_exits_2_naming_the_bad_engine_arg(tiny_model, vllm_env, tmp_path):
    config_path = tmp_path / "user_config.json"
    config_path.write_text(json.dumps(vllm_config(tiny_model, max_model_len="abc")))
    process = subprocess.run(
        [
            ENGINE_SERVER,
            "--dp-rank",
            "0",
            "--instance-id",
            "prefill-0",
            "--role",
            "prefill",
            "--host",
            "127.0.0.1",
            "--port",
            "18999",
            "--mgmt-port",
            "18998",
            "--master-dp-ip",
            "127.0.0.1",
            "--config-path",
            str(config_path),
            "--log-dir",
            str(tmp_path / "logs"),
            "--termination-message-path",
            str(tmp_path / "termination"),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        env=vllm_env,
        timeout=120,
    )
    assert process.returncode == 2, process.stderr[-2000:]
    assert f"{FIELD}.max_model_len" in process.stderr
    message = read_termination_message(str(tmp_path / "termination"))
    assert message.cause == "config_error" and message.message.startswith(f"{FIELD}.max_model_len"), message


@pytest.mark.parametrize("dp_size, dp_rank, kv_port, expected", [
    (1, 0, 27000, 27000),
    (1, 3, 27000, 27000),  # no data parallelism: vLLM's rank is 0 whatever the engine server's
    (2, 1, 27001, 27001),  # vLLM adds the rank: the variable holds 27000
])  # fmt: skip
def test_kv_port_puts_the_nixl_side_channel_on_it(monkeypatch, dp_size, dp_rank, kv_port, expected):
    """Single-container mode: P/D engines sharing a host must not collide on vLLM's default 5600."""
    import vllm.envs as envs

    from engine_server.engines.base import EngineOptions
    from engine_server.engines.vllm_args import kv_side_channel_environment

    options = EngineOptions(
        role="prefill",
        instance_id="p",
        dp_rank=dp_rank,
        host="10.0.0.7",
        port=8000,
        master_dp_ip="10.0.0.7",
        kv_port=kv_port,
        engine_args={"data_parallel_size": dp_size},
    )
    env = kv_side_channel_environment(options, environ={})
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    vllm_rank = dp_rank if dp_size > 1 else 0  # what vLLM's parallel config calls data_parallel_index
    assert envs.VLLM_NIXL_SIDE_CHANNEL_PORT + vllm_rank == expected
    assert envs.VLLM_NIXL_SIDE_CHANNEL_HOST == "10.0.0.7"  # inferred from --host
    # A host the operator set stays; a wildcard --host is no address to give decode engines.
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" not in kv_side_channel_environment(
        options, {"VLLM_NIXL_SIDE_CHANNEL_HOST": "nic0"}
    )
    options.host = "0.0.0.0"
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" not in kv_side_channel_environment(options, {})
    options.kv_port = None
    assert kv_side_channel_environment(options, {}) == {}
