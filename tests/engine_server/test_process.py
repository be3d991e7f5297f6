"""End to end: real `engine_server` processes with the sim engine, driven over gRPC and HTTP."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from google.protobuf import duration_pb2

from motor.v1 import engine_pb2, types_pb2
from tests.support import wait_for
from tests.support.engine_server_process import sim_config, watch

pytestmark = pytest.mark.processes

INIT, NORMAL, ABNORMAL = types_pb2.HEALTH_STATUS_INIT, types_pb2.HEALTH_STATUS_NORMAL, types_pb2.HEALTH_STATUS_ABNORMAL
SUCCESS, FAILURE = types_pb2.PROBE_OUTCOME_SUCCESS, types_pb2.PROBE_OUTCOME_FAILURE


def seconds(duration) -> float:
    return duration.ToNanoseconds() / 1e9


def probes(stream, count: int):
    """The next `count` probe messages of a WatchProbes stream."""
    return list(itertools.islice((m for m in stream if m.HasField("probe")), count))


def until(stream, predicate, limit: int = 200):
    """Messages of the stream up to and including the first one matching `predicate`."""
    seen = []
    for message in itertools.islice(stream, limit):
        seen.append(message)
        if predicate(message):
            return seen
    raise AssertionError(f"no matching message among {len(seen)}: {seen[-3:]}")


def first_probe_sent_after(stream, moment: float):
    """The first probe sent (and so sampled) after `moment` (epoch seconds)."""
    return until(stream, lambda m: m.HasField("probe") and m.probe.time.ToNanoseconds() / 1e9 > moment)[-1].probe


def probe_count(process, outcome: str = "success") -> float:
    return process.metrics().get(f'motor_engine_server_probes_total{{outcome="{outcome}"}}', 0.0)


def all_probes(process) -> float:
    return probe_count(process, "success") + probe_count(process, "failure")


def test_init_then_normal_then_probes_at_the_configured_interval(engine_server):
    es = engine_server(sim_config(engine_args={"startup_delay_s": 2.0, "utilization": 1}))
    loading = es.wait_status(INIT, timeout=20)
    assert "GET /health" in loading.reason
    assert not loading.probing
    normal = es.wait_status(NORMAL)
    assert "/health answered 200" in normal.reason
    stream = watch(es)
    first = next(stream)
    assert first.status.status == NORMAL and not first.HasField("probe")
    seen = probes(stream, 4)
    assert all(m.probe.outcome == SUCCESS for m in seen)
    assert all(seconds(m.probe.next_interval) == pytest.approx(0.3) for m in seen)
    assert all(m.probe.utilization_peak == 1 for m in seen)
    sent = [m.probe.time.ToNanoseconds() / 1e9 for m in seen]
    gaps = [b - a for a, b in zip(sent, sent[1:])]
    # 0.3 s apart, start to start; the upper bound only catches a stalled prober.
    assert all(0.25 <= gap < 3.0 for gap in gaps), gaps

    # The interval follows the utilization peak: busy (and making progress: requests complete)
    # -> the busy interval; without progress 90 % is no excuse -> 0.3 s; idle again -> 0.3 s.
    es.set_faults(utilization=90)
    traffic_stops = threading.Event()

    def traffic() -> None:
        while not traffic_stops.is_set():
            es.http("POST", "/v1/completions", {"prompt": "busy", "max_tokens": 4})

    sender = threading.Thread(target=traffic, daemon=True)
    sender.start()
    busy = first_probe_sent_after(stream, time.time())
    traffic_stops.set()
    sender.join(timeout=10)
    assert busy.utilization_peak == 90 and seconds(busy.next_interval) == pytest.approx(1.5)
    first_probe_sent_after(stream, time.time())  # its round may still see the last requests end
    hung_kernel = first_probe_sent_after(stream, time.time())
    assert hung_kernel.utilization_peak == 90 and seconds(hung_kernel.next_interval) == pytest.approx(0.3)
    es.set_faults(utilization=1)
    idle = first_probe_sent_after(stream, time.time())
    stream.cancel()
    assert idle.outcome == SUCCESS and idle.utilization_peak == 1
    assert seconds(idle.next_interval) == pytest.approx(0.3)


def test_fail_inference_turns_abnormal_after_max_failure_count_and_a_success_resets(engine_server):
    es = engine_server(sim_config(engine_args={"utilization": 1}, health={"max_failure_count": 3}))
    es.wait_status(NORMAL)
    stream = watch(es)
    next(stream)
    es.set_faults(fail_inference=True)
    seen = until(stream, lambda m: m.status.status == ABNORMAL)
    failures = [m.probe for m in seen if m.HasField("probe") and m.probe.outcome == FAILURE]
    assert [p.consecutive_failures for p in failures][-3:] == [1, 2, 3]
    assert all(p.counted and "500" in p.error for p in failures)
    abnormal = es.status()
    assert abnormal.status == ABNORMAL
    assert "3 consecutive" in abnormal.reason and "fail_inference" in abnormal.reason
    # /health stayed green all along: only the probes saw the failure.
    assert es.http("GET", "/health")[0] == 200

    es.set_faults(fail_inference=False)
    seen = until(stream, lambda m: m.status.status == NORMAL)
    stream.cancel()
    recovered = es.status()
    assert recovered.status == NORMAL and recovered.consecutive_failures == 0
    assert "succeed again" in recovered.reason


def long_request(es, words: int) -> threading.Thread:
    """A client request whose prompt keeps the sim engine prefilling (its steps are progress)."""
    answers: list = []

    def send():
        try:
            answers.append(
                es.http("POST", "/v1/completions", {"prompt": "w " * words, "max_tokens": 2}, timeout=120)[0]
            )
        except OSError as exc:  # the test ended (and killed the engine) first
            answers.append(exc)

    thread = threading.Thread(target=send, daemon=True)
    thread.answers = answers  # type: ignore[attr-defined]
    thread.start()
    return thread


def test_busy_engine_making_progress_with_failing_probes_stays_normal_and_uses_the_busy_interval(engine_server):
    # A long prefill holds the engine (30 s): probes wait behind it and time out (1 s).
    es = engine_server(sim_config(engine_args={"utilization": 95, "prefill_ms_per_token": 5},
                                  health={"max_failure_count": 2}))  # fmt: skip
    es.wait_status(NORMAL)
    stream = watch(es)
    next(stream)
    long_request(es, 6000)
    busy = probes(stream, 5)[1:]  # the first may have been sent before the request
    assert all(m.probe.outcome == FAILURE and not m.probe.counted for m in busy)
    assert all(m.probe.consecutive_failures == 0 and m.status.status == NORMAL for m in busy)
    assert all(seconds(m.probe.next_interval) == pytest.approx(1.5) for m in busy)
    assert seconds(es.status().probe_interval) == pytest.approx(1.5)

    # Between the threshold and busy: failures still do not count, the interval is unchanged.
    es.set_faults(utilization=50)
    middle = probes(stream, 3)[1:]  # the first may have sampled before the change
    assert all(not m.probe.counted and seconds(m.probe.next_interval) == pytest.approx(1.5) for m in middle)
    assert es.status().status == NORMAL

    # Idle again: back to the short interval, and the failures count (progress or not).
    es.set_faults(utilization=0)
    seen = until(stream, lambda m: m.status.status == ABNORMAL)
    stream.cancel()
    counted = [m.probe for m in seen if m.HasField("probe") and m.probe.counted]
    assert len(counted) >= 2 and seconds(counted[-1].next_interval) == pytest.approx(0.3)


def test_a_long_request_making_progress_never_turns_the_engine_abnormal(engine_server):
    """A long prefill that makes progress is load, not a failure (the false positives of
    sglang #22511 and ray #54070): probes time out behind it, nothing counts, the request ends."""
    es = engine_server(sim_config(engine_args={"utilization": 90, "prefill_ms_per_token": 2},
                                  health={"max_failure_count": 2}))  # fmt: skip
    es.wait_status(NORMAL)
    stream = watch(es)
    next(stream)
    request = long_request(es, 3000)  # 6 s of prefill
    failed = until(stream, lambda m: m.HasField("probe") and m.probe.outcome == FAILURE)[-1].probe
    assert "timed out" in failed.error and not failed.counted
    request.join(timeout=60)
    assert request.answers == [200]  # type: ignore[attr-defined]
    seen = until(stream, lambda m: m.HasField("probe") and m.probe.outcome == SUCCESS)
    stream.cancel()
    assert all(m.status.status == NORMAL for m in seen) and es.status().status == NORMAL
    assert not any(m.probe.counted for m in seen if m.HasField("probe"))


def test_hang_inference_on_a_busy_reading_turns_abnormal(engine_server):
    """The hang no utilization figure can hide: completions never answer, /health stays 200, the
    accelerator reads 90 %; nothing is produced, so the failed probes count."""
    es = engine_server(sim_config(engine_args={"utilization": 90}, health={"max_failure_count": 2}))
    es.wait_status(NORMAL)
    es.set_faults(hang_inference=True)
    abnormal = es.wait_status(ABNORMAL, timeout=30)
    assert "made no progress" in abnormal.reason and "90%" in abnormal.reason and "timed out" in abnormal.reason
    assert es.http("GET", "/health")[0] == 200
    es.set_faults(hang_inference=False)
    es.wait_status(NORMAL, timeout=30)


def test_hung_engine_turns_abnormal_and_recovers(engine_server):
    es = engine_server(
        sim_config(engine_args={"utilization": 1}, health={"max_failure_count": 2, "probe_timeout": 0.5})
    )
    es.wait_status(NORMAL)
    es.set_faults(hang=True)
    abnormal = es.wait_status(ABNORMAL, timeout=30)
    assert "timed out" in abnormal.reason
    es.set_faults(hang=False)
    es.wait_status(NORMAL, timeout=30)


@pytest.mark.parametrize("how", ["at run time", "by config"])
def test_engine_crash_reports_abnormal_and_exits_non_zero(engine_server, how):
    faults = {"crash_after_s": 3.0} if how == "by config" else {}
    es = engine_server(sim_config(engine_args={"utilization": 1, "faults": faults}))
    es.wait_status(NORMAL)
    stream = watch(es)
    assert next(stream).status.status == NORMAL
    if how == "at run time":
        try:
            es.set_faults(crash=True)
        except OSError:
            pass  # the process may be gone before the answer
    seen = until(stream, lambda m: m.status.status == ABNORMAL)
    assert "the engine died" in seen[-1].status.reason
    # Exits on its own, promptly (the bound only catches a process that stays up).
    assert es.wait_exit(timeout=5) == 1
    assert "exiting: the engine died" in es.output


def test_the_status_reports_requests_in_flight_averaged_over_the_last_second(engine_server):
    es = engine_server(sim_config(engine_args={"latency_ms": 3000}))
    es.wait_status(NORMAL)
    assert es.status().in_flight_average == 0.0 and es.status().HasField("in_flight_average")
    request = threading.Thread(target=lambda: es.http("POST", "/v1/completions", {"prompt": "slow"}))
    request.start()
    wait_for(lambda: es.status().in_flight_requests == 1, timeout=10, what="the slow request in flight")
    assert es.status().in_flight_average < 1.0  # the second before it held none
    wait_for(lambda: es.status().in_flight_average == 1.0, timeout=5, what="a whole second of one request")
    request.join(timeout=10)
    wait_for(lambda: es.status().in_flight_average == 0.0, timeout=5, what="a whole second of none")


def test_sigterm_drains_in_flight_requests_then_exits_zero(engine_server):
    es = engine_server(sim_config(engine_args={"latency_ms": 1500, "utilization": 1}, drain_timeout=20))
    es.wait_status(NORMAL)
    answers = []
    request = threading.Thread(target=lambda: answers.append(es.http("POST", "/v1/completions", {"prompt": "slow"})))
    request.start()
    wait_for(lambda: es.status().in_flight_requests == 1, timeout=10, what="the slow request in flight")
    os.kill(es.process.pid, signal.SIGTERM)
    wait_for(lambda: es.status().draining, timeout=10, what="the drain begun by SIGTERM")
    # From the start of the drain nothing new is admitted (a router sends it elsewhere).
    for path, body in (
        ("/v1/completions", {"prompt": "new"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "new"}]}),
    ):
        refused = refused_while_draining(es, path, body)
        assert refused.code == 503 and refused.headers["Retry-After"] == "1", path
        assert "draining" in json.loads(refused.read())["error"]["message"]
    request.join(timeout=20)
    assert answers and answers[0][0] == 200, answers
    assert es.wait_exit(timeout=20) == 0
    assert "shut down cleanly" in es.output


def refused_while_draining(es, path: str, body: dict) -> urllib.error.HTTPError:
    request = urllib.request.Request(
        f"http://127.0.0.1:{es.port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    return refused.value


def test_sigterm_gives_up_waiting_at_the_drain_timeout(engine_server):
    es = engine_server(sim_config(engine_args={"utilization": 1}, drain_timeout=0.5))
    es.wait_status(NORMAL)
    es.set_faults(hang=True)
    threading.Thread(
        target=lambda: es.http("POST", "/v1/completions", {"prompt": "stuck"}, timeout=30), daemon=True
    ).start()
    wait_for(lambda: es.status().in_flight_requests == 1, timeout=10, what="the stuck request in flight")
    os.kill(es.process.pid, signal.SIGTERM)
    assert es.wait_exit(timeout=20) == 0
    assert "drain deadline (0.5s) passed with 1 requests in flight" in es.output


def test_drain_rpc_stops_probing_and_waits_without_exiting(engine_server):
    # The engine answers in 1.5 s; the probe timeout is longer, so probes succeed and the status stays
    # NORMAL however long the steps below take (only draining may change, not health).
    es = engine_server(
        sim_config(engine_args={"latency_ms": 1500, "utilization": 1}, health={"probe_timeout": 10}, drain_timeout=20)
    )
    es.wait_status(NORMAL)
    wait_for(lambda: probe_count(es, "success") >= 1, timeout=20, what="a successful probe")
    threading.Thread(target=lambda: es.http("POST", "/v1/completions", {"prompt": "slow"}), daemon=True).start()
    wait_for(lambda: es.status().in_flight_requests == 1, timeout=10, what="the slow request in flight")

    short = es.stub().Drain(engine_pb2.DrainRequest(deadline=duration_pb2.Duration(nanos=100_000_000)), timeout=10)
    assert not short.drained and short.in_flight_requests == 1
    assert refused_while_draining(es, "/v1/completions", {"prompt": "new"}).code == 503  # the drain's start
    full = es.stub().Drain(engine_pb2.DrainRequest(), timeout=30)
    assert full.drained and full.in_flight_requests == 0
    status = es.status()
    assert status.draining and not status.probing and status.status == NORMAL
    before = all_probes(es)
    time.sleep(1.5)  # several probe intervals: none may be sent while draining
    assert all_probes(es) == before
    assert es.process.poll() is None

    with pytest.raises(grpc.RpcError) as error:
        es.stub().Drain(engine_pb2.DrainRequest(deadline=duration_pb2.Duration(seconds=-1)), timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_sleep_and_wake_up(engine_server):
    es = engine_server(sim_config(engine_args={"utilization": 1}))
    es.wait_status(NORMAL)
    wait_for(lambda: probe_count(es) >= 1, timeout=10, what="a probe")
    asleep = es.stub().Sleep(engine_pb2.SleepRequest(level=1), timeout=10).status
    assert asleep.sleeping and not asleep.probing and asleep.status == NORMAL
    assert es.stub().Sleep(engine_pb2.SleepRequest(), timeout=10).status.sleeping  # again: a no-op
    assert es.http("POST", "/v1/completions", {"prompt": "hi"})[0] == 503
    before = all_probes(es)
    time.sleep(1.0)
    assert all_probes(es) == before
    assert es.status().status == NORMAL

    with pytest.raises(grpc.RpcError) as error:
        es.stub().Sleep(engine_pb2.SleepRequest(level=3), timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "level" in error.value.details()

    awake = es.stub().WakeUp(engine_pb2.WakeUpRequest(), timeout=10).status
    assert not awake.sleeping and awake.probing
    assert es.http("POST", "/v1/completions", {"prompt": "hi"})[0] == 200
    wait_for(lambda: all_probes(es) > before, timeout=10, what="probes after waking up")
    assert not es.stub().WakeUp(engine_pb2.WakeUpRequest(), timeout=10).status.sleeping


def test_watch_probes_starts_with_the_current_status_and_disabled_probing_sends_none(engine_server):
    es = engine_server(sim_config(health={"enable_virtual_inference": False}))
    es.wait_status(NORMAL)
    stream = watch(es, timeout=3)
    first = next(stream)
    assert first.status.status == NORMAL and not first.status.probing and not first.HasField("probe")
    assert first.status.instance_id == "prefill-0" and first.status.role == types_pb2.ROLE_PREFILL
    time.sleep(1.0)
    assert all_probes(es) == 0
    stream.cancel()


def test_probes_stay_out_of_the_sim_engines_counters(engine_server):
    es = engine_server(sim_config(engine_args={"utilization": 1}))
    es.wait_status(NORMAL)
    wait_for(lambda: probe_count(es) >= 3, timeout=10, what="three probes")
    status, completion = es.http("POST", "/v1/completions", {"prompt": "one two three", "max_tokens": 5})
    assert status == 200
    status, chat = es.http(
        "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
        headers={"X-Request-Id": "real-42"},
    )  # fmt: skip
    assert status == 200 and chat["id"] == "chatcmpl-real-42"
    metrics = es.metrics()
    assert metrics['sim:request_success_total{model="sim-tiny"}'] == 2
    prompt = completion["usage"]["prompt_tokens"] + chat["usage"]["prompt_tokens"]
    assert metrics['sim:prompt_tokens_total{model="sim-tiny"}'] == prompt
    assert metrics['sim:generation_tokens_total{model="sim-tiny"}'] == 7
    # The engine server's own series are on the same /metrics.
    assert metrics['motor_engine_server_probes_total{outcome="success"}'] >= 3
    assert metrics["motor_engine_server_health_status"] == NORMAL
    assert metrics["motor_engine_server_probe_interval_seconds"] == pytest.approx(0.3)
    assert metrics["motor_engine_server_probe_latency_seconds_count"] >= 3


def test_decode_role_is_served_and_probed(engine_server):
    # The probe body of the decode role is checked in test_probing.py.
    es = engine_server(sim_config(role="decode", engine_args={"utilization": 1}), role="decode", instance_id="decode-0")
    assert es.wait_status(NORMAL).role == types_pb2.ROLE_DECODE
    wait_for(lambda: probe_count(es) >= 2, timeout=10, what="decode probes")


def test_union_role_falls_back_to_the_prefill_section(engine_server):
    es = engine_server(sim_config(role="prefill"), role="union", instance_id="union-0")
    status = es.wait_status(NORMAL)
    assert status.role == types_pb2.ROLE_UNION and status.engine_type == "sim"


@pytest.mark.parametrize("plane, code", [("port", 1), ("mgmt_port", 2)])
def test_a_taken_port_stops_the_start_with_a_clear_error(engine_server, plane, code):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        es = engine_server(sim_config(), **{plane: taken})
        assert es.wait_exit(timeout=30) == code
    assert f"cannot listen on 127.0.0.1:{taken}" in es.output


def test_health_is_checked_for_the_engines_whole_life_without_virtual_inference(engine_server):
    """/health was checked only until its first 200: a hang that freezes it went unseen."""
    es = engine_server(sim_config(engine_args={"utilization": 1},
                                  health={"enable_virtual_inference": False, "health_collector_timeout": 0.3,
                                          "max_failure_count": 2}))  # fmt: skip
    es.wait_status(NORMAL)
    es.set_faults(hang=True)
    abnormal = es.wait_status(ABNORMAL, timeout=30)
    assert "health checks failed: GET /health timed out after 0.3s" in abnormal.reason, abnormal.reason
    assert not abnormal.probing
    es.set_faults(hang=False)
    recovered = es.wait_status(NORMAL, timeout=30)
    assert recovered.reason == "GET /health answers 200 again" and recovered.consecutive_failures == 0


def test_load_s_keeps_the_engine_init_and_refusing_completions_for_that_long_then_normal(engine_server):
    # load_s: the seconds the simulated model takes to load (warm spares show their worth with it).
    began = time.monotonic()
    es = engine_server(sim_config(engine_args={"load_s": 3.0}))
    loading = es.wait_status(INIT, timeout=20)
    assert "GET /health" in loading.reason
    status, answer = es.http("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 503 and "loading" in json.dumps(answer)
    es.wait_status(NORMAL, timeout=20)
    assert time.monotonic() - began >= 3.0  # not NORMAL before the load is over
    status, _ = es.http("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200
