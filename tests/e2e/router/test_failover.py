"""No request is lost to a dying or hung engine: `motorctl up`'s router (its failover flags,
motorctl/router.py) and Motor at the seed's health settings, three simulated engines, open-loop load,
one engine's fault at a time. The requests the faulty engine caught are answered from elsewhere (the
router retries them once the engine fails them back or is killed), none waits over 15 s, and the
engine gets no new request 3 s after the fault began.

The router alone (no Motor), for streams: one cut mid-way by a SIGKILL ends at once, as a protocol
error (no terminating chunk, no `[DONE]`); one whose engine died before its first byte is retried."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import httpx
import pytest
import yaml

from motor.contract.deployment_file import deployment_from_dict
from motor.v1 import controller_pb2, controller_pb2_grpc, node_manager_pb2, node_manager_pb2_grpc
from motorctl.local_cluster import LocalCluster
from motorctl.router import FAILOVER_FLAGS, ROUTING_POLICY
from tests.support import REPO_ROOT, wait_for
from tests.support.engine_server_process import EngineServerProcess, sim_config
from tests.support.open_load import OpenLoad, http
from tests.support.router_process import RouterProcess, running

# The seed's health settings (issue 43's reference): virtual inference on, a probe every 2 s with a
# 5 s timeout, 3 failures, 20 s between probes of a busy engine; the rest at their defaults.
SEED_HEALTH = {
    "enable_virtual_inference": True,
    "probe_interval": 2.0,
    "probe_timeout": 5.0,
    "max_failure_count": 3,
    "busy_probe_interval": 20.0,
}
LONGEST_WAIT_S = 15.0  # a caught request's longest wait
ROUTED_AFTER_S = 3.0  # no new request reaches the faulty engine this long after the fault


def union(count: int) -> controller_pb2.Deployment:
    return deployment_from_dict(
        {
            "name": "failover",
            "model": "sim-tiny",
            "instance_groups": [{"name": "union", "role": "union", "count": count, "accelerators_per_engine": 1}],
            "engine_config": {
                "motor_engine_union_config": {
                    "engine_type": "sim",
                    "engine_args": {"model": "sim-tiny", "latency_ms": 20},
                    "health_check_config": SEED_HEALTH,
                }
            },
        }
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    local = LocalCluster(
        str(tmp_path_factory.mktemp("failover")),
        nodes=2,
        accelerators_per_node=2,
        heartbeat_interval=1.0,
        engine_port_base=36000,
        router_port=0,
    )
    for started in running(local):
        with started.credentials().channel(started.controller_address) as channel:
            controller_pb2_grpc.ControllerServiceStub(channel).ApplyDeployment(
                controller_pb2.ApplyDeploymentRequest(deployment=union(3)), timeout=30
            )
        yield started


def workers(cluster) -> set[str]:
    status, text = http("GET", cluster.router_url + "/list_workers")
    assert status == 200, text
    return set(json.loads(text)["urls"])


def three_serving(cluster) -> list[controller_pb2.Endpoint]:
    """The three endpoints, once the router holds exactly them (a replaced engine included)."""

    def ready():
        with cluster.credentials().channel(cluster.controller_address) as channel:
            listed = controller_pb2_grpc.ControllerServiceStub(channel).ListEndpoints(
                controller_pb2.ListEndpointsRequest(), timeout=5
            )
        endpoints = list(listed.endpoints)
        return endpoints if len(endpoints) == 3 and workers(cluster) == {e.url for e in endpoints} else None

    return wait_for(ready, timeout=120, interval=0.3, what="three engines serving and in the router")


def engine_pid(cluster, endpoint: controller_pb2.Endpoint) -> int:
    with cluster.credentials().channel(cluster.controller_address) as channel:
        instances = controller_pb2_grpc.ControllerServiceStub(channel).ListInstances(
            controller_pb2.ListInstancesRequest(), timeout=5
        )
    node_id = next(e.node_id for i in instances.instances for e in i.engines if e.engine_id == endpoint.engine_id)
    with cluster.credentials().channel(f"127.0.0.1:{cluster.node_ports[node_id]}") as channel:
        node = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
        return node.GetEngine(node_manager_pb2.GetEngineRequest(engine_id=endpoint.engine_id), timeout=5).engine.pid


class RoutedTo:
    """When the router last sent a request to `worker`: its per-worker decision counter
    (vllm_router_policy_decisions_total), read every 50 ms until the worker leaves the router's
    list (a replacement on the same address is another engine)."""

    def __init__(self, cluster, worker: str):
        argv = list(cluster.process("router").process.args)
        self.metrics_url = f"http://127.0.0.1:{argv[argv.index('--prometheus-port') + 1]}/metrics"
        self.cluster, self.worker = cluster, worker
        self.last_change: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def decisions(self) -> float:
        with urllib.request.urlopen(self.metrics_url, timeout=2) as reply:
            text = reply.read().decode()
        key = f'worker="{self.worker}"'
        return sum(
            float(line.rpartition(" ")[2])
            for line in text.splitlines()
            if line.startswith("vllm_router_policy_decisions_total") and key in line
        )

    def __enter__(self) -> RoutedTo:
        self._seen = self.decisions()
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            try:
                status, text = http("GET", self.cluster.router_url + "/list_workers", timeout=5)
                if status == 200 and self.worker not in json.loads(text)["urls"]:
                    return
                now, seen = time.monotonic(), self.decisions()
            except OSError:
                continue  # a slow answer on a loaded machine: the next read catches up
            if seen != self._seen:
                self._seen, self.last_change = seen, now

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_fault(cluster, inject, after_s: float = 12.0) -> tuple[OpenLoad, float, RoutedTo]:
    """Open-loop load (20 requests/s, 60 s client timeout), `inject(victim, pid)` 2 s in, then
    `after_s` of load; every request's answer is waited for."""
    victim = three_serving(cluster)[0]
    pid = engine_pid(cluster, victim)
    with RoutedTo(cluster, victim.url) as routed, OpenLoad(cluster.router_url, timeout=60) as load:
        time.sleep(2)
        fault_at = time.monotonic()
        inject(victim, pid)
        time.sleep(after_s)
    return load, fault_at, routed


def assert_no_request_lost(load: OpenLoad, fault_at: float, routed: RoutedTo) -> None:
    assert len(load.results) > 150
    assert load.failed() == [], f"{len(load.failed())} of {len(load.results)} failed: {load.failed()[:5]}"
    waits = [answered - sent for sent, _, answered in load.results]
    assert max(waits) <= LONGEST_WAIT_S, f"a caught request waited {max(waits):.1f} s"
    last = (routed.last_change or fault_at) - fault_at
    print(f"last routed {last:.2f} s after the fault, longest wait {max(waits):.2f} s, {len(load.results)} requests")
    assert last <= ROUTED_AFTER_S, f"the faulty engine still got a request {last:.1f} s after the fault"


def test_the_router_is_started_with_the_same_policy_and_failover_flags_by_motorctl_up_and_compose():
    with open(os.path.join(REPO_ROOT, "compose.yaml")) as f:
        command = yaml.safe_load(f)["services"]["router"]["command"]
    started = [*ROUTING_POLICY, *FAILOVER_FLAGS]
    flags = dict(zip(started[::2], started[1::2]))
    assert {flag: command[command.index(flag) + 1] for flag in flags if flag in command} == flags


def test_sigkill_of_an_engine_under_load_fails_no_request(cluster):
    load, fault_at, routed = run_fault(cluster, lambda victim, pid: os.kill(pid, signal.SIGKILL))
    assert_no_request_lost(load, fault_at, routed)


def test_sigstop_of_an_engine_under_load_its_caught_requests_are_answered_after_its_kill(cluster):
    load, fault_at, routed = run_fault(cluster, lambda victim, pid: os.kill(pid, signal.SIGSTOP))
    caught = [r for r in load.results if r[2] - r[0] > 1.0]
    assert caught, "no request reached the stopped engine: the fault was not exercised"
    assert_no_request_lost(load, fault_at, routed)


def test_inference_answering_500_with_health_200_fails_no_request(cluster):
    def fail_inference(victim, pid):
        status, text = http("POST", victim.url + "/sim/faults", {"fail_inference": True})
        assert status == 200, text

    load, fault_at, routed = run_fault(cluster, fail_inference)
    assert routed.last_change is not None, "no request reached the failing engine: the fault was not exercised"
    assert_no_request_lost(load, fault_at, routed)


def test_inference_hang_with_health_200_its_caught_requests_are_answered_from_elsewhere(cluster):
    """Needs the engine's stall watchdog (requests in flight and no progress for stall_timeout:
    out of the router, and the requests it holds failed back with 503 for the router to retry):
    without it, at the seed's settings, the hung engine leaves the router only after three 5 s
    probe timeouts and its requests wait for the kill."""

    def hang(victim, pid):
        status, text = http("POST", victim.url + "/sim/faults", {"hang_inference": True})
        assert status == 200, text

    load, fault_at, routed = run_fault(cluster, hang, after_s=15.0)
    assert [r for r in load.results if r[2] - r[0] > 1.0], "no request reached the hung engine"
    assert_no_request_lost(load, fault_at, routed)


# --- streams through the router alone ------------------------------------------------------


@pytest.fixture
def routed_engines(tmp_path):
    """The real router with motorctl up's failover flags in front of two simulated engines."""
    config = sim_config("union", {"model": "sim-tiny"}, {"enable_virtual_inference": False})
    engines, router = [], None
    try:  # whatever started is stopped, also when a later start fails
        for i in range(2):
            engines.append(EngineServerProcess(tmp_path, config, role="union", instance_id=f"u-{i}"))
        router = RouterProcess(str(tmp_path), extra=FAILOVER_FLAGS)
        for engine in engines:
            wait_for(lambda: engine.http("GET", "/health")[0] == 200, timeout=60, interval=0.2, what="engine up")
            router.add(f"http://127.0.0.1:{engine.port}")
        yield router, engines
    finally:
        if router is not None:
            router.stop()
        for engine in engines:
            engine.stop()


def test_a_stream_cut_mid_way_by_a_sigkill_ends_at_once_as_an_error(routed_engines):
    """A stream the engine has begun cannot be retried: the client gets what came and then an
    error at once. vllm-router 0.1.17 ends the response without its terminating chunk (no SSE
    error event): an OpenAI client (httpx underneath) raises RemoteProtocolError."""
    router, engines = routed_engines
    streaming, other = engines
    status, text = http("POST", f"{router.url}/remove_worker?url=http://127.0.0.1:{other.port}")
    assert status == 200, text  # the stream goes to `streaming`
    # A million tokens take the simulated engine tens of seconds to stream: the kill lands mid-way.
    body = {"model": "sim-tiny", "prompt": "x", "max_tokens": 1_000_000, "stream": True}
    events, killed_at = 0, None
    with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                assert line != "data: [DONE]", "the stream ended as if complete"
                events += line.startswith("data: ")
                if events == 200 and killed_at is None:
                    os.killpg(streaming.process.pid, signal.SIGKILL)
                    killed_at = time.monotonic()
    assert killed_at is not None and events >= 200
    assert time.monotonic() - killed_at < 5.0, "the cut stream hung"


def test_a_stream_whose_engine_dies_before_its_first_byte_is_retried_on_another_engine(routed_engines):
    router, engines = routed_engines
    stopped = engines[0]
    os.kill(stopped.process.pid, signal.SIGSTOP)  # takes connections, answers nothing
    body = {"model": "sim-tiny", "prompt": "x", "max_tokens": 8, "stream": True}
    outcomes: list[tuple[int, list[str], float]] = []

    def one():
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as reply:
            outcomes.append((reply.status_code, list(reply.iter_lines()), time.monotonic()))

    threads = [threading.Thread(target=one) for _ in range(4)]  # round robin: two reach the stopped engine
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    assert len(outcomes) < 4, "no stream reached the stopped engine: the fault was not exercised"
    os.killpg(stopped.process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for thread in threads:
        thread.join(timeout=30)
    assert len(outcomes) == 4
    for status, lines, ended in outcomes:
        assert status == 200
        assert [line for line in lines if line][-1] == "data: [DONE]", lines[-3:]
        assert ended - killed_at < 5.0


# The router's modes: plain (`motorctl up`'s default), and its multi-model mode (`--router-by-model`,
# `--router-pd`, compose), whose workers added at run time keep the router's own circuit settings:
# 5 failures in a row open it for 30 s, whatever the flags say (measured).
CIRCUIT_MODES = {"plain": ([], 2, 20.0), "multi-model": (["--enable-igw"], 1, 35.0)}


@pytest.mark.parametrize("mode", sorted(CIRCUIT_MODES))
def test_a_circuit_opened_by_a_burst_of_500s_lets_requests_through_again_within_seconds(tmp_path, mode):
    """The circuit breaker is a second line: an engine that failed a few requests in a row (two
    clients' requests that fail on every engine, each retried onto it 5 times) and serves again
    gets requests again after the circuit's timeout. With the router's default of 60 s, the only
    engine of a deployment answered nothing but 503 for a minute."""
    extra, failing_requests, reopened_within = CIRCUIT_MODES[mode]
    engine = EngineServerProcess(
        tmp_path, sim_config("union", {"model": "sim-tiny"}, {"enable_virtual_inference": False}), role="union"
    )
    router = RouterProcess(str(tmp_path), extra=[*FAILOVER_FLAGS, *extra])
    try:
        wait_for(lambda: engine.http("GET", "/health")[0] == 200, timeout=60, interval=0.2, what="engine up")
        router.add(f"http://127.0.0.1:{engine.port}")
        completion = {"model": "sim-tiny", "prompt": "x", "max_tokens": 2}
        engine.set_faults(fail_inference=True)
        statuses = [http("POST", router.url + "/v1/completions", completion)[0] for _ in range(failing_requests)]
        # 500s, and 503s once the engine's watchdog took it out of serving (three failures in a row).
        assert set(statuses) <= {500, 503} and len(statuses) == failing_requests, statuses
        engine.set_faults(fail_inference=False)
        status, text = http("POST", router.url + "/v1/completions", completion)
        assert status == 503 and "No available workers" in text, (status, text)  # the circuit is open
        opened = time.monotonic()
        wait_for(
            lambda: http("POST", router.url + "/v1/completions", completion)[0] == 200,
            timeout=reopened_within + 5,
            interval=0.5,
            what="requests through the circuit again",
        )
        assert time.monotonic() - opened < reopened_within
    finally:
        router.stop()
        engine.stop()
