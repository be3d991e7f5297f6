"""End to end on real processes: controller, two node managers, sim engine servers.

The cluster is the one `make run` starts (motorctl.local_cluster.LocalCluster), with the example
deployment: one prefill instance with two data-parallel ranks and one decode instance.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request

import grpc
import psutil
import pytest

from motor.ports import free_port
from motor.v1 import (
    controller_pb2,
    controller_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    node_manager_pb2,
    node_manager_pb2_grpc,
    types_pb2,
)
from tests.support import process_alive, wait_for
from tests.support.local_cluster import example_cluster, started
from tests.support.motorctl_up import motorctl_up_argv, start_motorctl_up

EXPECTED_ENGINES = {"prefill-0/rank0", "prefill-0/rank1", "decode-0/rank0"}


def _instances(stub) -> list:
    return list(stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=5).instances)


def _all_normal(stub) -> bool:
    engines = {e.engine_id: e for i in _instances(stub) for e in i.engines}
    return set(engines) == EXPECTED_ENGINES and all(
        e.health == types_pb2.HEALTH_STATUS_NORMAL and e.state == types_pb2.ENGINE_STATE_RUNNING
        for e in engines.values()
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    local = example_cluster(tmp_path_factory, "cluster", engine_port_base=31000)
    yield from started(local)


def test_every_engine_reaches_normal(cluster):
    with grpc.insecure_channel(cluster.controller_address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        wait_for(lambda: _all_normal(stub), timeout=90, interval=0.3, what="all three engines NORMAL")
        instances = {i.instance_id: i for i in _instances(stub)}
        assert instances["prefill-0"].state == controller_pb2.INSTANCE_STATE_READY
        prefill = instances["prefill-0"]
        rank0 = next(e for e in prefill.engines if e.dp_rank == 0)
        # Every rank of an instance is told the host of rank 0.
        assert prefill.master_dp_ip == rank0.host
        endpoints = stub.ListEndpoints(controller_pb2.ListEndpointsRequest(role=types_pb2.ROLE_PREFILL), timeout=5)
        assert {e.engine_id for e in endpoints.endpoints} == {"prefill-0/rank0", "prefill-0/rank1"}


def test_sigkill_of_an_engine_is_noticed_by_the_controller(cluster):
    with grpc.insecure_channel(cluster.controller_address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        wait_for(lambda: _all_normal(stub), timeout=90, interval=0.3, what="all engines NORMAL")
        victim = next(e for i in _instances(stub) for e in i.engines if e.engine_id == "decode-0/rank0")
        node_port = cluster.node_ports[victim.node_id]
        with grpc.insecure_channel(f"127.0.0.1:{node_port}") as node_channel:
            node = node_manager_pb2_grpc.NodeManagerServiceStub(node_channel)
            old = node.GetEngine(node_manager_pb2.GetEngineRequest(engine_id=victim.engine_id), timeout=5).engine
        assert old.pid > 0

        events = stub.WatchEvents(controller_pb2.WatchEventsRequest(), timeout=60)
        first = next(events)
        assert first.HasField("snapshot")
        feed = stub.WatchEndpoints(controller_pb2.WatchEndpointsRequest(), timeout=60)
        assert victim.engine_id in {e.engine_id for e in next(feed).added}  # the snapshot
        os.kill(old.pid, signal.SIGKILL)
        # A router following WatchEndpoints learns of it without polling: removed, later added
        # back once the replacement serves.
        assert _next_change_of(feed, victim.engine_id) == "removed"
        assert _next_change_of(feed, victim.engine_id) == "added"
        feed.cancel()
        failure = None
        for message in events:
            event = message.event
            if event.type == controller_pb2.EVENT_TYPE_ENGINE_FAILED and event.engine_id == victim.engine_id:
                failure = event
                break
        events.cancel()
        assert failure is not None
        assert "signal 9" in failure.message or "SIGKILL" in failure.message, failure.message

        # The controller restarts it (first restart immediately) and it becomes NORMAL again.
        def replaced():
            engine = next(e for i in _instances(stub) for e in i.engines if e.engine_id == victim.engine_id)
            return engine.restarts >= 1 and engine.health == types_pb2.HEALTH_STATUS_NORMAL

        wait_for(replaced, timeout=60, interval=0.3, what="decode-0/rank0 restarted and NORMAL")
        assert not process_alive(old.pid)


def _next_change_of(feed, engine_id: str) -> str:
    for message in feed:
        if engine_id in {e.engine_id for e in message.removed}:
            return "removed"
        if engine_id in {e.engine_id for e in message.added}:
            return "added"
    return "stream ended"


def test_a_drained_engine_leaves_the_endpoint_list_at_once(cluster):
    # Drain (as a SIGTERM also does): the engine answers new requests 503, so routers must stop
    # sending to it; its node manager reports the drain at once and the stream removes it.
    with grpc.insecure_channel(cluster.controller_address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        wait_for(lambda: _all_normal(stub), timeout=90, interval=0.3, what="all engines NORMAL")
        engine = next(e for i in _instances(stub) for e in i.engines if e.engine_id == "prefill-0/rank1")
        feed = stub.WatchEndpoints(controller_pb2.WatchEndpointsRequest(), timeout=60)
        assert engine.engine_id in {e.engine_id for e in next(feed).added}
        with grpc.insecure_channel(f"{engine.host}:{engine.mgmt_port}") as engine_channel:
            drained = engine_pb2_grpc.EngineServiceStub(engine_channel).Drain(engine_pb2.DrainRequest(), timeout=10)
        assert drained.drained
        assert _next_change_of(feed, engine.engine_id) == "removed"
        feed.cancel()
        listed = stub.ListEndpoints(controller_pb2.ListEndpointsRequest(), timeout=5).endpoints
        assert engine.engine_id not in {e.engine_id for e in listed}


def test_motorctl_up_runs_until_ctrl_c_and_leaves_nothing(tmp_path):
    """What `make run` does: start, show status, stop on SIGINT, no process left behind."""
    run_dir = tmp_path / "run"
    metrics_base = free_port()
    process = start_motorctl_up(
        motorctl_up_argv(
            run_dir, "--controller-port", "0", "--refresh", "0.5", "--metrics-port", str(metrics_base), nodes=2
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # metrics not on 9471: tests run side by side
    output: list[str] = []
    descendants: list[psutil.Process] = []
    try:
        # Not a terminal: the screen once, then one line per change ("22:26:41 engine
        # decode-0/rank0: RUNNING/NORMAL on node-a at 127.0.0.1:21004 pid 4711 (restarts 0)").
        engines: dict[str, str] = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            output.append(line)
            words = line.split()
            if len(words) >= 4 and words[1] == "engine" and "/rank" in words[2]:
                engines[words[2].rstrip(":")] = words[3]
            if len(engines) == 3 and set(engines.values()) == {"RUNNING/NORMAL"}:
                break
        assert set(engines.values()) == {"RUNNING/NORMAL"} and len(engines) == 3, "".join(output[-40:])
        assert any("grpcurl -plaintext" in seen for seen in output), "".join(output[-40:])
        assert sum("Motor local cluster" in seen for seen in output) == 1, "".join(output[-40:])
        # The screen lists every service's /metrics URL.
        listed = {
            seen.split()[0]: seen.split()[1]
            for seen in output
            if seen.strip().endswith("/metrics") and len(seen.split()) == 2
        }
        assert set(listed) == {"controller", "node-a", "node-b", "router", "front-door"}, "".join(output[-40:])
        assert listed["controller"] == f"http://127.0.0.1:{metrics_base}/metrics"
        # The front door's own series: what clients got, per model.
        with urllib.request.urlopen(listed["front-door"], timeout=10) as answer:
            assert "motor_front_door_requests" in answer.read().decode()
        # The router's own series (its port's /metrics would answer with an engine's).
        with urllib.request.urlopen(listed["router"], timeout=10) as answer:
            router_metrics = answer.read().decode()
        assert "vllm_router" in router_metrics and "motor_engine_server" not in router_metrics, router_metrics[:500]
        descendants = psutil.Process(process.pid).children(recursive=True)
        assert len(descendants) >= 6, "controller + 2 node managers + 3 engines expected"
        time.sleep(3)  # six refreshes of a quiet cluster: no screen is printed again
        process.send_signal(signal.SIGINT)
        rest, _ = process.communicate(timeout=60)
        output.append(rest)
        assert process.returncode == 0, "".join(output[-40:])
        assert "Motor local cluster" not in rest and "INSTANCES\n" not in rest, rest
        time.sleep(0.5)
        alive = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"left behind: {[p.cmdline() for p in alive]}"
        assert "no process left behind" in rest
    finally:
        # On a failure, leave nothing behind: the cluster's processes run in sessions of their own.
        if process.poll() is None:
            descendants += psutil.Process(process.pid).children(recursive=True)
            os.killpg(process.pid, signal.SIGKILL)
        for child in descendants:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
