"""The router's policy as Motor runs it (motorctl/router.py ROUTING_POLICY, --enable-igw, workers
added with their model): an engine with a backlog gets no new requests while another engine has
room. That is what lets an engine added by a scale-up take the load at once: under round robin
the added engine got only its share of new requests while the first engine's queue drained at
that engine's leftover capacity."""

from __future__ import annotations

import re
import threading
import time

from motorctl.router import TYPED_WORKER_FLAGS
from tests.support import wait_for
from tests.support.engine_server_process import EngineServerProcess, sim_config
from tests.support.open_load import http
from tests.support.router_process import RouterProcess

BACKLOG = 20  # requests queued on the first engine before the second joins
NEW = 10  # requests sent once both serve


def metric(engine, name: str) -> int:
    """The engine's `name`, summed over its labels."""
    status, text = engine.http("GET", "/metrics")
    assert status == 200, text
    return int(sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)))


def served(engine) -> int:
    return metric(engine, "vllm:request_success_total")


def add(router, engine) -> None:
    url = f"http://127.0.0.1:{engine.port}"
    status, text = http("POST", router.url + "/workers", {"url": url, "model_id": "sim-tiny"})
    assert status < 300, text
    wait_for(lambda: url in router.workers(), timeout=15, interval=0.1, what=f"{url} listed")


def test_an_engine_with_a_backlog_gets_no_new_requests_while_another_has_room(tmp_path):
    # One request at a time, 150 ms each: the backlog takes the first engine about 3 s to drain.
    config = sim_config("union", {"model": "sim-tiny", "max_num_seqs": 1, "latency_ms": 150},
                        {"enable_virtual_inference": False})  # fmt: skip
    busy, added = (EngineServerProcess(tmp_path, config, role="union", instance_id=f"u-{i}") for i in range(2))
    router = RouterProcess(str(tmp_path), extra=TYPED_WORKER_FLAGS)
    answers: list[int] = []

    def one():
        status, _ = http(
            "POST", router.url + "/v1/completions", {"model": "sim-tiny", "prompt": "x", "max_tokens": 2}, 60
        )
        answers.append(status)

    try:
        for engine in (busy, added):
            wait_for(lambda: engine.http("GET", "/health")[0] == 200, timeout=60, interval=0.2, what="engine up")
        add(router, busy)
        threads = [threading.Thread(target=one) for _ in range(BACKLOG)]
        for thread in threads:
            thread.start()
        wait_for(lambda: metric(busy, "vllm:num_requests_waiting") >= BACKLOG / 2, timeout=10, interval=0.05,
                 what="the backlog queued on the first engine")  # fmt: skip
        add(router, added)
        assert served(busy) < BACKLOG / 2, "the backlog drained before the second engine joined: not exercised"
        for _ in range(NEW):
            thread = threading.Thread(target=one)
            thread.start()
            threads.append(thread)
            time.sleep(0.1)
        for thread in threads:
            thread.join(timeout=60)
        assert answers == [200] * (BACKLOG + NEW)
        new_on_busy = served(busy) - BACKLOG
        # Round robin sends it half of them (measured: 5 of 10); the load-aware policy none, while
        # its queue is many requests longer than the other engine's.
        assert new_on_busy == 0, f"the engine with a backlog got {new_on_busy} of the {NEW} new requests"
        assert served(added) == NEW
    finally:
        router.stop()
        busy.stop()
        added.stop()
