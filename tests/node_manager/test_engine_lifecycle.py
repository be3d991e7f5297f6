"""What the engine server says of itself reaches the node manager: its cause of exit (the
termination message, shown before the log tail) and how long its stop takes (a stop deadline
shorter than that is raised, so a drain with requests in flight ends by itself, code 0).
Real node managers, real sim engine servers."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request

import pytest

from motor.contract import pbtime
from motor.service.grpc_server import aio_channel
from motor.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.support import async_wait_for
from tests.support.node_manager_harness import sim_config

pytestmark = pytest.mark.processes

RUNNING, STOPPED, FAILED = types_pb2.ENGINE_STATE_RUNNING, types_pb2.ENGINE_STATE_STOPPED, types_pb2.ENGINE_STATE_FAILED
ENGINE = "prefill-0/rank0"


async def test_a_dead_engines_reason_gives_its_own_cause_first_then_the_log(make_node):
    node = await make_node()
    await node.start(config_json=sim_config(faults={"crash_after_s": 1.5}))
    failed = await node.wait_state(ENGINE, FAILED)
    assert failed.state_reason.startswith("the engine died: sim fault: crash"), failed.state_reason
    cause, _, log = failed.state_reason.partition("; log: ")
    assert "exited with code 1 without being asked to stop" in cause and log, failed.state_reason


async def test_a_stop_waits_for_the_drain_the_engine_asked_for(make_node):
    # drain_timeout 4 s, a request taking 2 s in flight, and a stop deadline of 0.5 s: the node
    # manager waits the engine's stop grace instead, the request is answered, the exit is clean.
    config = json.loads(sim_config(latency_ms=2000))
    config["motor_engine_prefill_config"]["drain_timeout"] = 4.0
    node = await make_node()
    engine = await node.start(config_json=json.dumps(config))
    engine = await node.wait_state(ENGINE, RUNNING)
    running = await async_wait_for(
        lambda: (e := node.manager.get(ENGINE)).stop_grace and e, timeout=10, what="the engine's stop grace"
    )
    assert running.stop_grace > 4.0
    assert pbtime.seconds((await node.get(ENGINE)).stop_grace) == running.stop_grace

    def complete() -> int:
        request = urllib.request.Request(
            f"http://127.0.0.1:{engine.spec.port}/v1/completions", data=json.dumps({"prompt": "slow"}).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status

    answer = asyncio.ensure_future(asyncio.to_thread(complete))
    async with aio_channel(f"127.0.0.1:{engine.spec.mgmt_port}") as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)

        async def in_flight() -> bool:
            return (await stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=5)).status.in_flight_requests == 1

        await async_wait_for(in_flight, timeout=10, what="the request in flight")
    stopped = await node.stop(ENGINE, deadline=pbtime.duration(0.5))
    assert await answer == 200
    assert stopped.state == STOPPED and stopped.exit_code == 0, stopped
    assert "after SIGTERM" in stopped.state_reason and "SIGKILL" not in stopped.state_reason, stopped.state_reason
    assert os.path.exists(node.manager.get(ENGINE).termination_path)


async def test_a_drain_is_reported_to_the_controller_at_once(make_node, fake_controller):
    # A drained engine answers new requests 503: routers must stop sending to it now (the
    # controller removes its endpoint on this report), not at the next heartbeat.
    node = await make_node(controller=fake_controller.address)
    await async_wait_for(lambda: fake_controller.registrations, timeout=10)
    engine = await node.start()
    await node.wait_state(ENGINE, RUNNING)
    async with aio_channel(f"127.0.0.1:{engine.spec.mgmt_port}") as channel:
        drained = await engine_pb2_grpc.EngineServiceStub(channel).Drain(engine_pb2.DrainRequest(), timeout=10)
    assert drained.drained
    report = await async_wait_for(
        lambda: [r for r in fake_controller.reports if r.engine.draining], timeout=10, what="a report of the drain"
    )
    assert report[0].reason == "draining" and report[0].engine.state == RUNNING
    assert report[0].engine.health == types_pb2.HEALTH_STATUS_NORMAL  # draining, not sick: nothing restarts it


async def test_a_stall_is_reported_at_once_and_a_long_one_gets_the_engine_killed(make_node, fake_controller):
    # Requests in flight and no progress: the engine server's watchdog says "not serving"; the node
    # manager tells the controller now (routers follow it), and kills the engine once the stall
    # has lasted stall_kill_after (ABNORMAL for abnormal_threshold heartbeats).
    config = json.loads(sim_config())
    config["motor_engine_prefill_config"]["health_check_config"].update(
        enable_virtual_inference=False, stall_timeout=0.5, stall_kill_after=3.0
    )
    node = await make_node(controller=fake_controller.address)
    await async_wait_for(lambda: fake_controller.registrations, timeout=10)
    engine = await node.start(config_json=json.dumps(config))
    await node.wait_state(ENGINE, RUNNING)
    base = f"http://127.0.0.1:{engine.spec.port}"

    def post(path: str, body: dict, timeout: float = 60) -> int:
        request = urllib.request.Request(
            base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except Exception:
            return 0

    assert await asyncio.to_thread(post, "/sim/faults", {"hang_inference": True}) == 200
    caught = [asyncio.ensure_future(asyncio.to_thread(post, "/v1/completions", {"prompt": "x"})) for _ in range(3)]
    report = await async_wait_for(
        lambda: [r for r in fake_controller.reports if r.engine.not_serving_reason], timeout=10, what="not serving"
    )
    assert report[0].reason.startswith("not serving: no progress for 0.") and "3 requests in flight" in report[0].reason
    assert report[0].engine.state == RUNNING and report[0].engine.health == types_pb2.HEALTH_STATUS_NORMAL
    # Failed back at the stall (a router retries them elsewhere), not left waiting for the kill.
    assert [await asyncio.wait_for(c, 10) for c in caught] == [503] * 3
    failed = await node.wait_state(ENGINE, FAILED, timeout=30)
    assert "abnormal heartbeats" in failed.state_reason and "no progress for" in failed.state_reason, (
        failed.state_reason
    )
