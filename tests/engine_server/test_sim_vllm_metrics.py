"""The simulated engine exports vLLM's request-level series under vLLM's names and labels, so the
dashboard's request panels and the TTFT alert (deploy/) work on a simulated cluster as on vLLM."""

from __future__ import annotations

import importlib.util
import os
import threading

import pytest

from motor.contract.engine_args import VLLM_MAX_NUM_SEQS as SIM_MAX_NUM_SEQS
from tests.support import require, wait_for
from tests.support.engine_server_process import sim_config

pytestmark = pytest.mark.processes

NORMAL = 2
L = 'engine="0",model_name="sim-tiny"'
NAMES = [
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:request_success",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
]


def test_requests_show_in_vllms_series(engine_server):
    # No probes: they take a seat like any request (sim_capacity.py), and these counts are the client's.
    es = engine_server(
        sim_config(engine_args={"utilization": 1, "latency_ms": 1500}, health={"enable_virtual_inference": False})
    )
    es.wait_status(NORMAL)
    slow = threading.Thread(target=es.http, args=("POST", "/v1/completions", {"prompt": "a b", "max_tokens": 4}))
    slow.start()
    metrics = wait_for(
        lambda: (m := es.metrics()).get(f"vllm:num_requests_running{{{L}}}") == 1 and m,
        timeout=10,
        interval=0.05,
        what="one request running",
    )
    assert metrics[f"vllm:kv_cache_usage_perc{{{L}}}"] == pytest.approx(1 / SIM_MAX_NUM_SEQS)
    slow.join(timeout=30)
    status, _ = es.http("POST", "/v1/completions", {"prompt": "one two three", "max_tokens": 5})
    assert status == 200
    metrics = es.metrics()
    assert metrics[f"vllm:time_to_first_token_seconds_count{{{L}}}"] == 2
    assert metrics[f"vllm:time_to_first_token_seconds_sum{{{L}}}"] >= 3.0  # 1.5 s each, probes left out
    assert metrics[f"vllm:inter_token_latency_seconds_count{{{L}}}"] == 3 + 4
    assert metrics['vllm:request_success_total{engine="0",finished_reason="length",model_name="sim-tiny"}'] == 2
    assert metrics[f"vllm:generation_tokens_total{{{L}}}"] == 9
    assert metrics[f"vllm:num_requests_running{{{L}}}"] == 0
    assert metrics[f"vllm:num_requests_waiting{{{L}}}"] == 0
    assert metrics[f"vllm:kv_cache_usage_perc{{{L}}}"] == 0


def test_the_names_are_vllms_own():
    require(importlib.util.find_spec("vllm") is not None, "vLLM")
    folder = importlib.util.find_spec("vllm").submodule_search_locations[0]
    source = open(os.path.join(folder, "v1", "metrics", "loggers.py")).read()
    assert [name for name in NAMES if f'"{name}"' not in source] == []
    assert 'labelnames = ["model_name", "engine"]' in source
