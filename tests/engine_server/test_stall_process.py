"""The stall watchdog on real engine_server processes (sim engine), probing off as by default."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from motor.v1 import types_pb2
from tests.support import wait_for
from tests.support.engine_server_process import sim_config, watch

pytestmark = pytest.mark.processes

NORMAL, ABNORMAL = types_pb2.HEALTH_STATUS_NORMAL, types_pb2.HEALTH_STATUS_ABNORMAL
NO_PROBES = {"enable_virtual_inference": False}


def send_in_background(
    es, count: int, prompt: str = "hello", timeout: float = 60.0, statuses: list[int] | None = None
) -> list[int]:
    """Start `count` completions in threads; their statuses are appended to `statuses` as they end."""
    statuses = [] if statuses is None else statuses

    def one() -> None:
        try:
            status, _ = es.http("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2}, timeout=timeout)
        except OSError:  # cut: the engine server was stopped
            status = 0
        statuses.append(status)

    for _ in range(count):
        threading.Thread(target=one, daemon=True).start()
    return statuses


def test_a_hang_under_traffic_leaves_rotation_and_fails_back_what_it_holds_with_503(engine_server):
    """The requests a hung engine holds (non-streamed, and a stream before its first byte) are
    answered 503 "engine not serving: ..." once the stall is seen, so that a router retries them
    elsewhere at once; so is every new client request while it lasts; a probe brings it back."""
    es = engine_server(sim_config(health={**NO_PROBES, "stall_timeout": 1.0, "stall_kill_after": 60}))
    es.wait_status(NORMAL)
    es.set_faults(hang_inference=True)
    began = time.monotonic()
    answers: list[tuple[int, dict, float]] = []

    def one(stream: bool) -> None:
        body = {"prompt": "hello", "max_tokens": 2, "stream": stream}
        status, answer = es.http("POST", "/v1/completions", body, timeout=60)
        answers.append((status, answer, time.monotonic() - began))

    for stream in (False, False, False, True):
        threading.Thread(target=one, args=(stream,), daemon=True).start()
    wait_for(lambda: len(answers) == 4, timeout=30, what="the caught requests answered")
    status = es.status()
    assert status.not_serving_reason.startswith("no progress for 1.") and "4 requests in flight" in (
        status.not_serving_reason
    )
    assert status.status == NORMAL  # out of the routers; not to be killed yet
    assert status.in_flight_requests == 0  # cancelled in the engine
    for code, answer, waited in answers:
        assert code == 503, answer
        assert answer["error"]["message"] == f"engine not serving: {status.not_serving_reason}", answer
        assert answer["error"]["type"] == "ServiceUnavailableError" and answer["error"]["code"] == 503
        assert 0.7 <= waited < 4.0, f"answered {waited:.1f} s after the hang (stall_timeout 1 s)"

    asked = time.monotonic()
    code, answer = es.http("POST", "/v1/completions", {"prompt": "new", "max_tokens": 2})
    assert code == 503 and answer["error"]["message"].startswith("engine not serving: no progress for 1.")
    assert time.monotonic() - asked < 2.0  # at once, not after a stall of its own

    es.set_faults(hang_inference=False)  # nothing in flight to progress: the recovery probe notices
    wait_for(lambda: es.status().not_serving_reason == "", timeout=15, what="serving again")
    assert es.http("POST", "/v1/completions", {"prompt": "back", "max_tokens": 2})[0] == 200


def test_a_stall_lasting_stall_kill_after_turns_abnormal(engine_server):
    es = engine_server(sim_config(health={**NO_PROBES, "stall_timeout": 0.5, "stall_kill_after": 2.0}))
    es.wait_status(NORMAL)
    es.set_faults(hang_inference=True)
    send_in_background(es, 2)
    abnormal = es.wait_status(ABNORMAL, timeout=20)
    assert "no progress for 2." in abnormal.reason and "stall_kill_after 2 s" in abnormal.reason
    assert es.http("GET", "/health")[0] == 200  # the fault /health does not show


def test_inference_answering_500_leaves_rotation_and_a_probe_brings_it_back(engine_server):
    es = engine_server(sim_config(health={**NO_PROBES, "probe_interval": 0.3}))
    es.wait_status(NORMAL)
    es.set_faults(fail_inference=True)
    for _ in range(3):
        assert es.http("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 500
    status = wait_for(lambda: (s := es.status()).not_serving_reason and s, timeout=10, what="not serving")
    assert "3 client requests in a row failed with a server error" in status.not_serving_reason
    assert es.http("GET", "/health")[0] == 200 and status.status == NORMAL
    code, answer = es.http("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert code == 503, answer  # retried elsewhere by a router, and not one more failure in a row
    assert answer["error"]["message"].startswith("engine not serving: 3 client requests in a row failed"), answer
    es.set_faults(fail_inference=False)  # no client request comes: the recovery probe notices
    wait_for(lambda: es.status().not_serving_reason == "", timeout=15, what="serving again")


@pytest.mark.slow
def test_a_30s_prefill_and_a_slow_queue_behind_it_never_leave_rotation(engine_server):
    """A 30 s chunked prefill (100 ms per prompt word, a step every 50 ms) and 10 requests queued
    behind it (1 s of prefill each) at the default stall_timeout: never not serving."""
    es = engine_server(sim_config(engine_args={"prefill_ms_per_token": 100}, health=NO_PROBES))
    es.wait_status(NORMAL)
    stream = watch(es, timeout=120)
    seen = []

    def follow() -> None:
        try:
            seen.extend(stream)
        except grpc.RpcError:
            pass  # cancelled at the end

    threading.Thread(target=follow, daemon=True).start()
    statuses = send_in_background(es, 1, prompt=" ".join(["word"] * 300), timeout=120)
    time.sleep(0.5)
    send_in_background(es, 10, prompt=" ".join(["word"] * 10), timeout=120, statuses=statuses)
    wait_for(lambda: len(statuses) == 11, timeout=90, interval=0.5, what="every request answered")
    stream.cancel()
    assert statuses == [200] * 11
    assert seen and all(m.status.not_serving_reason == "" and m.status.status == NORMAL for m in seen)
    assert es.status().not_serving_reason == ""
