"""Towards the controller: registration, heartbeats, re-registration, outages; TLS and metrics."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from motor.ports import free_port
from motor.service.grpc_server import TlsFiles, aio_channel
from motor.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from motorctl.pki_command import make_dev_pki
from tests.support import async_wait_for
from tests.support.node_manager_harness import alive, serve_controller, sim_config

RUNNING, FAILED = types_pb2.ENGINE_STATE_RUNNING, types_pb2.ENGINE_STATE_FAILED


@pytest.mark.processes
async def test_registers_heartbeats_and_registers_again_when_refused(make_node, fake_controller):
    node = await make_node(node_id="node-b", controller=fake_controller.address, accelerators=[0, 1])
    first = await async_wait_for(lambda: fake_controller.registrations, timeout=10)
    info = first[0].node
    assert info.node_id == "node-b" and info.address == f"127.0.0.1:{node.server.port}"
    assert list(info.accelerator_ids) == [0, 1] and info.accelerator_type == "sim"
    assert info.port_range_start > 0 and info.port_range_end >= info.port_range_start
    # Probes every 30 s: the engine's report (last_probe) then stays the same from beat to beat.
    await node.start(accelerator_ids=[1], config_json=sim_config(probe_interval=30))
    beats = await async_wait_for(
        lambda: [h for h in fake_controller.heartbeats if h.engines and h.engines[0].state == RUNNING], timeout=30
    )
    assert beats[0].generation == 1 and beats[0].engines[0].health == types_pb2.HEALTH_STATUS_NORMAL
    # On one StreamHeartbeats stream: a full list first, then deltas (empty while nothing changes).
    await async_wait_for(lambda: any(b.delta and not b.engines for b in fake_controller.streamed), timeout=10)
    assert not fake_controller.streamed[0].delta

    fake_controller.refuse_heartbeats = 1  # stale generation: the node must register again
    await async_wait_for(lambda: len(fake_controller.registrations) >= 2, timeout=10)
    assert [e.engine_id for e in fake_controller.registrations[1].engines] == ["prefill-0/rank0"]
    await async_wait_for(lambda: fake_controller.heartbeats[-1].generation == 2, timeout=10)
    first_after = next(b for b in fake_controller.streamed if b.generation == 2)
    assert not first_after.delta and [e.engine_id for e in first_after.engines] == [
        "prefill-0/rank0"
    ]  # a new stream: full
    assert (await node.get("prefill-0/rank0")).state == RUNNING


@pytest.mark.processes
async def test_engines_keep_running_and_supervision_goes_on_while_the_controller_is_down(make_node, fake_controller):
    node = await make_node(controller=fake_controller.address)
    first = await node.start(dp_rank=0, accelerator_ids=[0])
    second = await node.start(dp_rank=1, accelerator_ids=[1])
    await node.wait_state("prefill-0/rank0", RUNNING)
    await node.wait_state("prefill-0/rank1", RUNNING)
    port = int(fake_controller.address.rsplit(":", 1)[1])
    await fake_controller.server.stop(grace=0)

    await asyncio_sleep(1.5)  # several failed heartbeats
    os.kill(second.pid, signal.SIGKILL)  # a failure while the controller is away is still handled
    await node.wait_state("prefill-0/rank1", FAILED, timeout=10)
    engine = await node.get("prefill-0/rank0")
    assert engine.state == RUNNING and engine.pid == first.pid and alive(first.pid)

    # The controller comes back on the same address: heartbeats resume and carry the failure.
    server, _ = await serve_controller(fake_controller, f"127.0.0.1:{port}")
    try:
        fake_controller.heartbeats.clear()
        beat = await async_wait_for(lambda: fake_controller.heartbeats, timeout=30, what="heartbeats resumed")
        states = {e.engine_id: e.state for e in beat[0].engines}
        assert states == {"prefill-0/rank0": RUNNING, "prefill-0/rank1": FAILED}
    finally:
        await server.stop(grace=0)


async def asyncio_sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


@pytest.mark.processes
async def test_engines_serve_the_nodes_certificate_and_only_its_manager_may_drain_them(make_node, tmp_path):
    pki = make_dev_pki(str(tmp_path / "pki"), ["node-a"])
    as_controller = TlsFiles(cert=pki.cert("controller"), key=pki.key("controller"), ca=pki.ca)
    node = await make_node(
        tls_cert=pki.cert("node-a"), tls_key=pki.key("node-a"), tls_ca=pki.ca, client_tls=as_controller
    )
    engine = await node.start(config_json=sim_config())
    # NORMAL: the node manager's status calls went over mutual TLS with the node's certificate.
    running = await node.wait_state("prefill-0/rank0", RUNNING, timeout=30)
    assert running.health == types_pb2.HEALTH_STATUS_NORMAL
    target = f"127.0.0.1:{engine.spec.mgmt_port}"
    async with aio_channel(target) as channel:  # the engine speaks TLS only
        with pytest.raises(grpc.aio.AioRpcError):
            await engine_pb2_grpc.EngineServiceStub(channel).GetStatus(engine_pb2.GetStatusRequest(), timeout=2)
    as_viewer = TlsFiles(cert=pki.cert("viewer"), key=pki.key("viewer"), ca=pki.ca)
    async with aio_channel(target, as_viewer) as channel:  # a viewer reads; only node-a's manager drains
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        assert (await stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=10)).status.instance_id == "prefill-0"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Drain(engine_pb2.DrainRequest(), timeout=10)
    assert (
        refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        and "needs role node-manager" in refused.value.details()
    )


async def test_a_request_cannot_choose_the_engines_tls_files(make_node):
    node = await make_node()
    config = json.loads(sim_config())
    config["motor_engine_prefill_config"]["mgmt_tls_config"] = {
        "enable_tls": True,
        "cert_file": "/etc/ssl/private/x.pem",
    }
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await node.start(config_json=json.dumps(config))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        "spec.config_json.motor_engine_prefill_config.mgmt_tls_config: not accepted in a request"
        in refused.value.details()
    )


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


HEALTHS = ("init", "normal", "abnormal")


def sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    raise AssertionError(f"no {name}{labels} in the scrape")


@pytest.mark.processes
async def test_prometheus_metrics(make_node, fake_controller):
    # /metrics is served on the node manager's event loop, which this test shares: scrape from a thread.
    port = free_port()
    node = await make_node(controller=fake_controller.address, metrics_port=port)
    engine = await node.start(config_json=sim_config(probe_interval=0.2, max_failure_count=1))
    await node.wait_state("prefill-0/rank0", RUNNING)
    os.kill(engine.pid, signal.SIGSTOP)
    await node.wait_state("prefill-0/rank0", FAILED, timeout=30)
    await async_wait_for(lambda: fake_controller.heartbeats, timeout=10)
    text = await asyncio.to_thread(scrape, port)
    assert 'motor_node_manager_engines{node="node-a",state="failed"} 1.0' in text
    assert 'motor_node_manager_engines{node="node-a",state="running"} 0.0' in text
    assert 'motor_node_manager_engine_kills_total{node="node-a",reason="abnormal"} 1.0' in text
    assert 'motor_node_manager_heartbeat_latency_seconds_count{node="node-a"}' in text
    await node.start(config_json=sim_config(), generation=1)
    text = await asyncio.to_thread(scrape, port)
    ids = {"node": "node-a", "instance_id": "prefill-0", "engine_id": "prefill-0/rank0"}
    assert sample(text, "motor_node_manager_engine_restarts_total", **ids) == 1
    await node.wait_state("prefill-0/rank0", RUNNING)
    text = await asyncio.to_thread(scrape, port)
    assert sum(sample(text, "motor_node_manager_engine_health", **ids, health=h) for h in HEALTHS) == 1
