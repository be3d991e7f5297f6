"""The engine server with the real vLLM CPU engine inside, end to end.

One shared server (module fixture) runs the non-destructive tests in file order, then the
destructive ones: a hung engine core, a drain, then SIGTERM. A second server, reporting a busy
accelerator, checks that a hung engine core still turns ABNORMAL (busy without progress is no
excuse) and that the engine core's death ends the process within a second; a third (decode role) checks decode probes
and that SIGKILL of the
engine server leaves no engine core behind.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import grpc
import psutil
import pytest
from google.protobuf import duration_pb2

from motor.v1 import engine_pb2
from tests.support import wait_for
from tests.support.vllm_engines import (
    ABNORMAL,
    FAILURE,
    INIT,
    NORMAL,
    SUCCESS,
    VllmServer,
    parse_metrics,
    start_server,
    vllm_config,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_FAILURES = 2
PROBE_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def shared(tiny_model, vllm_env, tmp_path_factory, request) -> dict:
    """The shared server, with the statuses a watcher saw from before /health came up."""
    tmp = tmp_path_factory.mktemp("vllm-shared")
    config = vllm_config(
        tiny_model,
        # Default interval (5 s) and the CPU build's own utilization sampler.
        # The stall watchdog acts late here (tests/vllm/test_vllm_stall*.py test it): these tests
        # judge the probes' own verdict and a drain, holding requests on a stopped engine core.
        health={
            "max_failure_count": MAX_FAILURES,
            "probe_timeout": PROBE_TIMEOUT,
            "utilization_window": 1.0,
            "stall_timeout": 60,
            "stall_kill_after": 120,
        },
    )
    server = start_server(tmp, config, vllm_env, request)
    server.wait_mgmt_up()
    watcher = server.watch()
    first = server.status()  # the node manager's first heartbeat: arms virtual inference
    normal = server.wait_status(NORMAL)
    # The stream delivers on its own thread: GetStatus may read NORMAL before the stream's
    # NORMAL event has reached the watcher.
    wait_for(lambda: NORMAL in [s.status for s in watcher.statuses()], timeout=10, what="NORMAL on the stream")
    return {"server": server, "watcher": watcher, "first": first, "normal": normal}


def test_init_until_health_then_normal(shared):
    server: VllmServer = shared["server"]
    # The management plane answers before vLLM is even imported (the configuration check
    # imports it: seconds), then vLLM loads for 10+ s: the first answers are INIT, with why.
    assert shared["first"].status == INIT, shared["first"]
    assert shared["first"].engine_type == "vllm"
    assert shared["normal"].reason, "every status carries a reason"
    statuses = shared["watcher"].statuses()
    seen = [s.status for s in statuses]
    assert seen[0] == INIT and NORMAL in seen, seen
    assert "checking the configuration" in statuses[0].reason, statuses[0]
    assert any(s.status == INIT and "GET /health" in s.reason for s in statuses), [s.reason for s in statuses]
    # The inference plane is vLLM's own OpenAI server.
    answer = server.http("/v1/completions", {"model": server_model(server), "prompt": "Hello", "max_tokens": 3})
    assert answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] == 3
    chat = server.http(
        "/v1/chat/completions",
        {"model": server_model(server), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert chat["choices"][0]["message"]["role"] == "assistant"


def server_model(server: VllmServer) -> str:
    return json.loads(server.http("/v1/models"))["data"][0]["id"]


def test_probes_every_5s_under_low_utilization(shared):
    watcher = shared["watcher"]
    # The previous test's completions are the engine core's progress: a probe round that saw
    # them read busy (20 s interval). From the first round without client traffic on, probes
    # read idle: their own tokens are no progress.
    mark = time.monotonic()
    idle = wait_for(
        lambda: next((at for at, p in watcher.probes(since=mark) if p.utilization_peak == 0.0), None),
        timeout=90,
        what="an idle probe round",
    )
    probes = wait_for(lambda: (p := watcher.probes(since=idle)) and len(p) >= 3 and p, timeout=60, what="three probes")
    for _, probe in probes:
        assert probe.outcome == SUCCESS, probe
        assert probe.next_interval.ToTimedelta().total_seconds() == 5.0, probe
        assert probe.utilization_peak == 0.0, probe
    gaps = [b[0] - a[0] for a, b in zip(probes, probes[1:])]
    assert all(3.5 < gap < 8.0 for gap in gaps), gaps
    status = shared["server"].status()
    assert status.probing and status.probe_interval.ToTimedelta().total_seconds() == 5.0


def _counting_series(values: dict[str, float], types: dict[str, str]) -> dict[str, float]:
    """vLLM's counter and histogram samples (the series that count requests, tokens, latencies)."""
    counting = {}
    for key, value in values.items():
        name = key.split("{", 1)[0]
        if not name.startswith("vllm:"):
            continue
        family = name
        for suffix in ("_total", "_count", "_sum", "_bucket"):
            if name.endswith(suffix):
                family = name[: -len(suffix)]
                break
        # Multiprocess mode names counter families with their _total suffix.
        if types.get(family) in ("counter", "histogram", "summary") or types.get(name) == "counter":
            counting[key] = value
    return counting


def _scrape(server: VllmServer):
    values, types = parse_metrics(server.http("/metrics"))
    return values, _counting_series(values, types)


def _one(values: dict[str, float], prefix: str) -> float:
    """Sum of the samples of one series over its labels."""
    return sum(v for k, v in values.items() if k == prefix or k.startswith(prefix + "{"))


def test_vllm_metrics_count_only_real_requests(shared):
    server: VllmServer = shared["server"]
    watcher = shared["watcher"]
    # One /metrics with vLLM's series and the engine server's own.
    values, counting = _scrape(server)
    assert "motor_engine_server_health_status" in values and _one(values, "vllm:request_success_total") >= 0
    assert len(counting) > 50, "vLLM's counters and histograms are on /metrics"

    # N probes and no other traffic: no vllm:* counter or histogram moves.
    mark = time.monotonic()
    probes_before = _one(values, "motor_engine_server_probes_total")
    wait_for(lambda: len(watcher.probes(since=mark)) >= 2, timeout=30, what="two more probes")
    values_after_probes, counting_after_probes = _scrape(server)
    assert _one(values_after_probes, "motor_engine_server_probes_total") >= probes_before + 2
    moved = {k: (counting.get(k), v) for k, v in counting_after_probes.items() if counting.get(k, 0.0) != v}
    assert not moved, f"probes leaked into vLLM's metrics: {moved}"

    # M real requests: the counters move by exactly what they did.
    model = server_model(server)
    usages = []
    for prompt, max_tokens in (("The quick brown fox", 5), ("Hello, world", 3), ("1", 1)):
        answer = server.http(
            "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        )
        usages.append(answer["usage"])
    # Client ids that look like probe ids (even the old `{ts}_virtual` form) are counted like any
    # other: only the engine server's own probe ids are filtered.
    for client_id in ("order_virtual", f"{int(time.time() * 1000)}_virtual", "order_virtual_goods"):
        answer = server.http(
            "/v1/completions",
            {"model": model, "prompt": "virtual", "max_tokens": 2, "ignore_eos": True},
            headers={"X-Request-Id": client_id},
        )
        usages.append(answer["usage"])
    real = len(usages)
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    generation_tokens = sum(u["completion_tokens"] for u in usages)
    after = _scrape(server)[1]

    def delta(series: str) -> float:
        return _one(after, series) - _one(counting_after_probes, series)

    assert delta("vllm:request_success_total") == real
    assert delta("vllm:e2e_request_latency_seconds_count") == real
    assert delta("vllm:request_queue_time_seconds_count") == real
    assert delta("vllm:request_prompt_tokens_count") == real
    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta("vllm:request_generation_tokens_sum") == generation_tokens
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens_total") == generation_tokens
    assert delta("vllm:time_to_first_token_seconds_count") == real
    assert delta("vllm:inter_token_latency_seconds_count") == generation_tokens - real
    assert delta("vllm:prefix_cache_queries_total") == prompt_tokens
    assert delta("vllm:iteration_tokens_total_sum") == prompt_tokens + generation_tokens


def test_sleep_is_refused_on_the_cpu_build(shared):
    server: VllmServer = shared["server"]
    with pytest.raises(grpc.RpcError) as raised:
        server.stub.Sleep(engine_pb2.SleepRequest(level=1), timeout=10)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "sleep" in raised.value.details()
    assert server.status().status == NORMAL and not server.status().sleeping


def still_running(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those not exited (a zombie has exited: it only waits for init to reap it)."""
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


def _completion_in_thread(server: VllmServer, max_tokens: int) -> list:
    """Send one completion from a thread; the list gets its answer."""
    answers: list = []
    body = {"model": server_model(server), "prompt": "wait", "max_tokens": max_tokens, "ignore_eos": True}
    thread = threading.Thread(
        target=lambda: answers.append(server.http("/v1/completions", body, timeout=180)), daemon=True
    )
    thread.start()
    answers.append(thread)
    return answers


def test_hung_engine_core_turns_abnormal_then_recovers(shared):
    """SIGSTOP of the engine core alone, with a client request waiting on it: everything else
    (API server, its loop, /health) lives on, yet the utilization reads idle (the core makes no
    progress), so failed probes count and the status turns ABNORMAL."""
    server: VllmServer = shared["server"]
    watcher = shared["watcher"]
    core = server.engine_core()
    os.kill(core.pid, signal.SIGSTOP)
    try:
        waiting = _completion_in_thread(server, max_tokens=4)
        wait_for(lambda: server.status().in_flight_requests == 1, timeout=30, what="the request in flight")
        mark = time.monotonic()
        abnormal = server.wait_status(ABNORMAL, timeout=60)
        assert "consecutive virtual-inference probes failed" in abnormal.reason, abnormal.reason
        failed = [p for _, p in watcher.probes(since=mark) if p.outcome == FAILURE]
        # (A first round may still see the previous test's completions as progress: not counted.)
        counted = [p for p in failed if p.counted]
        assert len(counted) >= MAX_FAILURES and failed[-1].counted, failed
        assert all(p.utilization_peak == 0.0 for p in counted), "a stopped engine core makes no progress"
        # vLLM's own health check does not see a hung engine core (vLLM #39863).
        assert server.http("/health") == ""
    finally:
        os.kill(core.pid, signal.SIGCONT)
    recovered = server.wait_status(NORMAL, timeout=60)
    assert recovered.consecutive_failures == 0
    waiting[0].join(timeout=60)
    assert waiting[1]["usage"]["completion_tokens"] == 4, waiting
    assert server.process.poll() is None


def test_drain_refuses_new_requests_with_503_and_lets_in_flight_ones_finish(shared):
    server: VllmServer = shared["server"]
    core = server.engine_core()
    os.kill(core.pid, signal.SIGSTOP)  # holds the request below in flight for as long as needed
    try:
        in_flight = _completion_in_thread(server, max_tokens=8)
        wait_for(lambda: server.status().in_flight_requests == 1, timeout=30, what="the request in flight")
        drain = server.stub.Drain(engine_pb2.DrainRequest(deadline=duration_pb2.Duration(seconds=0)), timeout=10)
        assert not drain.drained and drain.in_flight_requests == 1, drain
        assert server.status().draining
        body = json.dumps({"model": server_model(server), "prompt": "new", "max_tokens": 1}).encode()
        for path in ("/v1/completions", "/v1/chat/completions"):
            request = urllib.request.Request(server.url + path, data=body, headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "1"
            assert "draining" in json.loads(refused.value.read())["error"]["message"]
        assert server.http("/health") == ""  # not an inference request: still answered
    finally:
        os.kill(core.pid, signal.SIGCONT)
    in_flight[0].join(timeout=60)
    assert in_flight[1]["usage"]["completion_tokens"] == 8, in_flight


def test_sigterm_drains_and_exits_0_within_the_stop_grace_it_states(shared):
    server: VllmServer = shared["server"]
    tree = server.tree()
    stop_grace = server.status().stop_grace.ToNanoseconds() / 1e9
    assert stop_grace >= 10.0, "drain_timeout (10 s) plus vLLM's shutdown"
    sent = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    # What a node manager waits before SIGKILL: an idle vLLM exits well within it, by itself.
    assert server.process.wait(timeout=stop_grace) == 0, server.output[-3000:]
    print(f"idle vLLM engine server: SIGTERM -> exit 0 in {time.monotonic() - sent:.2f}s (stop_grace {stop_grace:g}s)")
    alive = still_running(tree)
    assert not alive, f"left behind: {alive}"
    assert "shut down cleanly" in server.output
    message = server.termination_message()
    assert (message.exit_code, message.cause) == (0, "stopped"), message
    shared["watcher"].ended.wait(10)


# -- a busy engine, then the engine core's death ----------------------------------------------


def test_a_hung_engine_core_reading_busy_turns_abnormal_and_engine_core_death_exits_fast(
    tiny_model, vllm_env, tmp_path, request
):
    config = vllm_config(
        tiny_model,
        health={
            "max_failure_count": MAX_FAILURES,
            "probe_timeout": PROBE_TIMEOUT,
            "utilization_window": 0.5,
            "busy_probe_interval": 1.0,
            "stall_timeout": 60,  # the probes' verdict is tested here, not the watchdog's
            "stall_kill_after": 120,
        },
        # The accelerator reports 95 %, as NVML does for a kernel spinning in a hung collective.
        motor_utilization=95,
    )
    server = start_server(tmp_path, config, vllm_env, request)
    server.wait_mgmt_up()
    server.status()
    server.wait_status(NORMAL)
    watcher = server.watch()
    wait_for(lambda: watcher.probes(), timeout=30, what="a probe")
    core = server.engine_core()
    tree = server.tree()

    os.killpg(core.pid, signal.SIGSTOP)
    try:
        mark = time.monotonic()
        abnormal = server.wait_status(ABNORMAL, timeout=60)
        # A busy figure excuses nothing when the engine core produces nothing.
        assert "made no progress" in abnormal.reason and "95%" in abnormal.reason, abnormal.reason
        counted = [p for _, p in watcher.probes(since=mark) if p.outcome == FAILURE and p.counted]
        assert len(counted) >= MAX_FAILURES and all(p.utilization_peak == 95.0 for p in counted), counted
        assert server.http("/health") == ""  # vLLM's own check still answers 200
    finally:
        os.killpg(core.pid, signal.SIGCONT)
    server.wait_status(NORMAL, timeout=60)

    # The engine core dies: ABNORMAL, and the process exits non-zero within about a second.
    killed = time.monotonic()
    os.kill(core.pid, signal.SIGKILL)
    code = server.process.wait(timeout=30)
    exit_after = time.monotonic() - killed
    assert code not in (0, None), server.output[-3000:]
    print(f"engine_server exited {exit_after:.2f}s after the engine core died")
    assert exit_after < 5.0, f"exited {exit_after:.2f}s after the engine core died"  # a hang bound
    watcher.ended.wait(10)
    last = watcher.statuses()[-1]
    assert last.status == ABNORMAL and "engine-core process" in last.reason and "SIGKILL" in last.reason, last
    # The engine server waited for (or killed) all its processes before it exited.
    alive = still_running(tree)
    assert not alive, f"left behind: {alive}"
    message = server.termination_message()
    assert (message.exit_code, message.cause) == (1, "engine_died"), message
    assert "engine-core process" in message.message and "SIGKILL" in message.message, message


def test_decode_probes_work_and_sigkill_of_the_engine_server_takes_the_engine_core_along(
    tiny_model, vllm_env, tmp_path, request
):
    """A decode engine's probes carry kv_transfer_params (do_virtual); vLLM without a KV
    connector answers them. Then SIGKILL: vLLM does not watch its parent (vLLM #55846), the
    engine server's engine-core set-up does."""
    config = vllm_config(tiny_model, role="decode", health={"probe_interval": 1.0, "utilization_window": 0.5})
    server = start_server(tmp_path, config, vllm_env, request, role="decode")
    server.wait_mgmt_up()
    server.status()
    server.wait_status(NORMAL)
    watcher = server.watch()
    probe = wait_for(lambda: watcher.probes() and watcher.probes()[-1][1], timeout=30, what="a decode probe")
    assert probe.outcome == SUCCESS, probe
    watcher.cancel()

    core = server.engine_core()
    tree = server.tree()
    assert os.getpgid(core.pid) != os.getpgid(server.process.pid), "the engine core has its own process group"
    server.process.kill()  # only the engine server's pid, as an OOM killer would
    server.process.wait(timeout=10)
    gone, alive = psutil.wait_procs(tree, timeout=15)
    assert not alive, f"orphans left behind: {alive}"
