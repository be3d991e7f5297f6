"""The door's KV routing with real processes: the front door (--kv-routing), the real vllm-router
and two simulated engine servers with prefix caches publishing their KV events on ZMQ. A repeated
prefix goes to the engine holding it; an engine killed gets nothing (its refusal falls back to the
router, 0 failed requests) and its index is dropped when the table no longer lists it."""

from __future__ import annotations

import json
import time
import urllib.request

from motor.ports import free_port
from motorctl.router import TYPED_WORKER_FLAGS
from tests.support import wait_for
from tests.support.door_process import DoorProcess, door_log
from tests.support.engine_server_process import EngineServerProcess, sim_config
from tests.support.open_load import http
from tests.support.router_process import RouterProcess
from tests.support.scraped import kv_decisions, metric

MODEL = "sim-tiny"
SYSTEM = " ".join(f"rule{n}" for n in range(320))  # 20 blocks of 16 tokens


def push(door: DoorProcess, engines) -> None:
    body = {"served": {MODEL: None}, "engines": [
        {"engine_id": f"u-{i}", "generation": 1, "url": f"http://127.0.0.1:{e.port}", "models": [MODEL],
         "kv_events": f"tcp://127.0.0.1:{e.events_port}", "tokenizer": "sim"} for i, e in engines]}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{door.table_port}/served", data=json.dumps(body).encode(), method="PUT"
    )
    with urllib.request.urlopen(request, timeout=2) as reply:
        assert reply.status == 204


def ask(door: DoorProcess, question: str) -> None:
    body = {"model": MODEL, "prompt": f"{SYSTEM} {question}", "max_tokens": 2}
    status, answer = http("POST", door.url + "/v1/completions", body, 30)
    assert status == 200, answer


def served(engine) -> float:
    return metric(f"http://127.0.0.1:{engine.port}", "vllm:request_success_total")


def test_a_repeated_prefix_goes_to_its_engine_and_a_dead_engine_gets_nothing(tmp_path):
    engines = []
    for i in range(2):
        events_port = free_port()
        args = {"model": MODEL, "kv_cache_blocks": 64, "kv_events_port": events_port, "prefill_ms_per_token": 1}
        engine = EngineServerProcess(tmp_path, sim_config("union", args, {"enable_virtual_inference": False}),
                                     role="union", instance_id=f"u-{i}")  # fmt: skip
        engine.events_port = events_port
        engines.append(engine)
    router = RouterProcess(str(tmp_path), extra=TYPED_WORKER_FLAGS)
    door = None
    try:
        for engine in engines:
            wait_for(lambda: engine.http("GET", "/health")[0] == 200, timeout=60, interval=0.2, what="engine up")
            url = f"http://127.0.0.1:{engine.port}"
            status, text = http("POST", router.url + "/workers", {"url": url, "model_id": MODEL})
            assert status < 300, text
            wait_for(lambda: url in router.workers(), timeout=15, interval=0.1, what=f"{url} listed")
        door = DoorProcess(router.url, door_log(tmp_path), served={MODEL: None}, extra=["--kv-routing"])
        push(door, enumerate(engines))
        time.sleep(0.5)  # (a ZMQ subscription joins a moment after it connects: events before it are lost)
        ask(door, "first")
        holder = max(engines, key=served)
        other = next(e for e in engines if e is not holder)
        wait_for(lambda: metric(door.url, "motor_front_door_kv_indexed_blocks") >= 20, timeout=10, interval=0.1,
                 what="the holder's BlockStored events in the door's index")  # fmt: skip
        for n in range(6):
            ask(door, f"question {n}")
        assert (served(holder), served(other)) == (7, 0)
        hits = metric(f"http://127.0.0.1:{holder.port}", "vllm:prefix_cache_hits_total")
        assert hits == 6 * 320, hits  # each repeat found the 20 blocks cached
        assert kv_decisions(door.url, "cached") == 6

        holder.stop()  # dead before the sync says so: the door's choice fails, the router takes it
        ask(door, "after the holder died")
        assert kv_decisions(door.url, "fallback") == 1
        assert served(other) == 1
        push(door, [(1 if other is engines[1] else 0, other)])  # the sync's next push: the holder gone
        wait_for(lambda: metric(door.url, "motor_front_door_kv_indexed_blocks") <= 20, timeout=5, interval=0.1,
                 what="the dead engine's index dropped")  # fmt: skip
        for n in range(3):
            ask(door, f"again {n}")
        assert served(other) == 4
        assert kv_decisions(door.url, "fallback") == 1
    finally:
        if door is not None:
            door.stop()
        router.stop()
        for engine in engines:
            engine.stop()
