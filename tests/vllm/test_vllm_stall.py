"""The stall watchdog on the real vLLM CPU engine, under a controller and a node manager
(`motorctl up`'s LocalCluster), probing off:

- no false positive: long chunked prefills (four different prompts of 4000 tokens, 8 tokens a
  step, so about 2000 steps) keep the engine listed for routers throughout (steps are progress);
- the real failure: SIGSTOP of the engine-core process only, then requests (the API
  server and its /health stay up, vLLM #39863's shape): out of the endpoints within 3 s with an
  ENGINE_NOT_SERVING event naming the stall, the requests it held answered 503 (failed back),
  then killed (ABNORMAL after stall_kill_after) and replaced.

One cluster and two vLLM start-ups (the engine and its replacement) for the module.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import psutil
import pytest

from motor.v1 import controller_pb2, engine_pb2, engine_pb2_grpc
from motorctl.local_cluster import LocalCluster
from tests.support import wait_for
from tests.support.vllm_engines import START_TIMEOUT, engine_core_of, vllm_cluster, vllm_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ENGINE = "prefill-0/rank0"
NODE = "stall-a"
STALL_TIMEOUT, STALL_KILL_AFTER = 1.0, 4.0
LONG_PROMPT_TOKENS = 4000  # token ids: 500 chunks of 8 tokens each (a step takes ms on the tiny model)


@pytest.fixture(scope="module")
def stack(tiny_model, vllm_env, tmp_path_factory):
    section = vllm_config(
        tiny_model,
        health={
            "enable_virtual_inference": False,
            "stall_timeout": STALL_TIMEOUT,
            "stall_kill_after": STALL_KILL_AFTER,
        },
        max_model_len=4096,
        max_num_batched_tokens=8,
        max_num_seqs=4,
    )["motor_engine_prefill_config"]
    with vllm_cluster(
        tiny_model,
        vllm_env,
        str(tmp_path_factory.mktemp("vllm-stall")),
        section,
        lambda local, stub: wait_listed(stub),
        node_id_prefix="stall",
        engine_port_base=37400,
        # The tiny model's config says 512 positions; its rotary embedding serves longer prompts.
        env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"},
    ) as (local, stub):
        yield local, stub


def listed(stub, timeout: float = 5) -> bool:
    endpoints = stub.ListEndpoints(controller_pb2.ListEndpointsRequest(), timeout=timeout).endpoints
    return any(e.engine_id == ENGINE for e in endpoints)


def listed_or_unknown(stub) -> bool | None:
    """Whether the engine is listed; None when the controller did not answer in time (four prefills
    fill both cores of a 2-core machine: a read can wait there for seconds, which says nothing of
    the engine; the events asserted below do)."""
    try:
        return listed(stub, timeout=15)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
        return None


def wait_listed(stub, timeout: float = START_TIMEOUT) -> None:
    wait_for(lambda: listed(stub), timeout=timeout, interval=0.5, what=f"{ENGINE} (vLLM) listed for routers")


def engine_on_node(stub):
    nodes = stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=5).nodes
    return next(e for n in nodes for e in n.engines if e.engine_id == ENGINE)


def events(local: LocalCluster, kind: str) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-m", "motorctl.cli", "--controller", local.controller_address, "--output", "json", "events"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    found = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    return [e for e in found if e.get("type") == kind and e.get("engine_id") == ENGINE]


def complete_in_background(url: str, body: dict, statuses: list, count: int) -> list[threading.Thread]:
    def one() -> None:
        request = urllib.request.Request(
            url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                statuses.append(response.status)
        except urllib.error.HTTPError as exc:
            statuses.append(exc.code)
        except OSError as exc:  # cut: the engine was killed
            statuses.append(type(exc).__name__)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


def in_flight(engine) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{engine.spec.mgmt_port}") as channel:
        status = engine_pb2_grpc.EngineServiceStub(channel).GetStatus(engine_pb2.GetStatusRequest(), timeout=5)
    return status.status.in_flight_requests


def test_long_chunked_prefills_queued_four_deep_never_leave_the_endpoints(stack):
    local, stub = stack
    engine = engine_on_node(stub)
    url = f"http://127.0.0.1:{engine.spec.port}"
    statuses: list = []
    started = time.monotonic()
    threads = []
    for n in range(4):  # different prompts: no prefix-cache hit shortens the others
        prompt = [(i * 7 + n * 13) % 400 + 20 for i in range(LONG_PROMPT_TOKENS)]
        threads += complete_in_background(url, {"prompt": prompt, "max_tokens": 2}, statuses, 1)
    # In flight, or already answered: a status call can wait behind the busy core (2 cores).
    wait_for(lambda: statuses or in_flight(engine) >= 1, timeout=30, what="the long prompts in flight")
    delisted, answered = [], 0
    while any(t.is_alive() for t in threads) and time.monotonic() - started < 240:
        seen = listed_or_unknown(stub)
        answered += seen is not None
        if seen is False:
            delisted.append(round(time.monotonic() - started, 2))
        time.sleep(0.1)
    took = time.monotonic() - started
    assert statuses == [200] * 4, statuses
    # Meaningful only if the prefills outlasted the stall timeout twice over (2.7 s on a fast
    # machine). Not more rounds of prompts: after them the SIGSTOP test below saw its requests
    # answered although it had stopped the engine core (cause not found).
    assert took > 2 * STALL_TIMEOUT, f"the prefills took only {took:.1f}s"
    assert answered, "the controller answered no endpoints read during the prefills"
    assert delisted == [], f"left the endpoints at {delisted} s during {took:.1f} s of prefill"
    assert events(local, "EVENT_TYPE_ENGINE_NOT_SERVING") == []


def test_sigstop_of_the_engine_core_leaves_the_endpoints_within_3s_then_it_is_replaced(stack):
    local, stub = stack
    engine = engine_on_node(stub)
    url = f"http://127.0.0.1:{engine.spec.port}"
    statuses: list = []
    core = engine_core_of(engine.pid)
    # The core hangs, then traffic comes: the API server takes the requests and they wait. Not
    # the other way round: the tiny model decodes 3,000 tokens in under half a second on a fast
    # run, so requests sent first may be answered before any signal reaches the core.
    os.kill(core.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        complete_in_background(
            url, {"prompt": "tell me a long story", "max_tokens": 3000, "ignore_eos": True}, statuses, 3
        )
        wait_for(
            lambda: not listed(stub),
            timeout=30,
            interval=0.05,
            what=f"{ENGINE} out of the endpoints",
            detail=lambda: f"in flight: {in_flight(engine)}; answered: {statuses}",
        )
        out_after = time.monotonic() - stopped_at
        with urllib.request.urlopen(url + "/health", timeout=5) as health:
            assert health.status == 200  # the API server lives: /health cannot see this hang
        assert out_after <= 3.0, f"out of the endpoints only {out_after:.2f}s after SIGSTOP"
        told = wait_for(lambda: events(local, "EVENT_TYPE_ENGINE_NOT_SERVING"), timeout=10, what="the event")
        message = told[0]["message"]
        assert f"engine {ENGINE} on {NODE} not serving: no progress for 1." in message, message
        assert "3 requests in flight; out of the endpoints" in message, message

        failed = wait_for(
            lambda: events(local, "EVENT_TYPE_ENGINE_FAILED"), timeout=60, interval=0.5, what="killed as ABNORMAL"
        )
        assert "abnormal heartbeats" in failed[-1]["message"] and "no progress for" in failed[-1]["message"], failed
        assert not core.is_running() or core.status() == psutil.STATUS_ZOMBIE
        wait_for(lambda: len(statuses) == 3, timeout=30, what="the caught requests ended")
        assert statuses == [503] * 3, statuses  # failed back at the stall (a router retries them), not cut by the kill
    finally:
        if core.is_running():
            os.kill(core.pid, signal.SIGCONT)
    wait_listed(stub)
    assert engine_on_node(stub).pid != engine.pid
