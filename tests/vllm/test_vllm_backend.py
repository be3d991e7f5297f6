"""The vLLM backend's parts that run without starting vLLM: argument checks (they import vLLM's
parser and read the tiny model's config), probe-id matching, the patch guard, the CPU sampler."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from engine_server.engines.vllm_probe_filter import (
    VllmPatchError,
    _check,
    is_probe_external_id,
    is_probe_internal_id,
)
from engine_server.engines.vllm_utilization import ProcessCpuSampler
from motor.errors import ConfigError
from tests.support import wait_for
from tests.vllm.conftest import ENGINE_SERVER, LEAN_CPU_ARGS, vllm_config

FIELD = "motor_engine_prefill_config.engine_args"


@pytest.mark.parametrize(
    "request_id, probe",
    [
        ("cmpl-1795313754871_virtual-0", True),  # completion, prompt index 0
        ("cmpl-1795313754871_virtual-12", True),
        ("chatcmpl-1795313754871_virtual", True),
        ("1795313754871_virtual", True),
        ("cmpl-order_virtual_goods-0", False),  # "_virtual" inside a real id
        ("cmpl-virtual-0", False),
        ("cmpl-1795313754871_virtualx-0", False),
        ("", False),
        (None, False),
    ],
)
def test_probe_external_ids(request_id, probe):
    assert is_probe_external_id(request_id) is probe


def test_probe_internal_ids_carry_a_random_suffix():
    assert is_probe_internal_id("cmpl-1795313754871_virtual-0-1a2b3c4d")  # completion
    assert is_probe_internal_id("chatcmpl-1795313754871_virtual-1a2b3c4d")  # chat: no prompt index
    assert not is_probe_internal_id("cmpl-1795313754871_virtual")  # the suffix is missing: not internal
    assert not is_probe_internal_id("cmpl-abc-0-1a2b3c4d")


def test_a_missing_or_changed_vllm_method_fails_loudly():
    class Drifted:
        def _update_stats_from_finished(self, req_state, reason, stats):  # renamed parameter
            pass

    with pytest.raises(VllmPatchError, match="_update_stats_from_output is missing"):
        _check(Drifted, "_update_stats_from_output", ["self", "req_state"])
    with pytest.raises(VllmPatchError, match="expected"):
        _check(Drifted, "_update_stats_from_finished", ["self", "req_state", "finish_reason", "iteration_stats"])


def test_cpu_sampler_reads_a_busy_process_tree_and_an_idle_one():
    # The busy loop runs in a grandchild: the sampler follows children, as with vLLM's workers.
    busy = subprocess.Popen(["sh", "-c", f"{sys.executable} -c 'while True: pass' & wait"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        wait_for(lambda: psutil.Process(busy.pid).children(), timeout=10, what="the busy grandchild")
        busy_sampler, idle_sampler = ProcessCpuSampler(lambda: [busy.pid]), ProcessCpuSampler(lambda: [idle.pid])
        assert ProcessCpuSampler(lambda: []).read() == 0.0  # before the engine core exists
        busy_sampler.read(), idle_sampler.read()  # start the measurement windows
        time.sleep(1.0)
        # One spinning process is 1/ncpu of the machine; generous bounds (other tests share the CPUs).
        assert busy_sampler.read() > 10.0
        assert idle_sampler.read() < 5.0
    finally:
        for child in psutil.Process(busy.pid).children(recursive=True):
            child.kill()
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()


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
            ENGINE_SERVER, "--dp-rank", "0", "--instance-id", "prefill-0", "--role", "prefill",
            "--host", "127.0.0.1", "--port", "18999", "--mgmt-port", "18998", "--master-dp-ip", "127.0.0.1",
            "--config-path", str(config_path), "--log-dir", str(tmp_path / "logs"),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        env=vllm_env,
        timeout=120,
    )
    assert process.returncode == 2, process.stderr[-2000:]
    assert f"{FIELD}.max_model_len" in process.stderr
