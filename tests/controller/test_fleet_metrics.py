"""The controller's fleet series (rendered from its tables, kept as text between scrapes) and
Prometheus engine discovery: they show what ListNodes/ListInstances show, and follow changes."""

from __future__ import annotations

import asyncio
import sys
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from controller.events import EventBus
from controller.fleet_metrics import FleetSeries, engine_targets
from controller.instances import READY, InstanceRecord
from controller.nodes import NODE_LOST, NODE_READY, NODE_SUSPECT, NodeRuntime
from controller.slots import EngineSlot
from controller.state import ClusterState
from motor.clock import SYSTEM_CLOCK
from motor.contract.names import enum_short_name, role_name
from motor.ports import free_port
from motor.service.loop_lag import cpu_wait
from motor.service.metrics_http import ServiceTelemetry
from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T
from tests.controller.test_core import running_example


async def scrape(series: FleetSeries) -> dict[tuple, float]:
    text = b"".join([piece async for piece in series.render()]).decode()
    samples = {}
    for family in text_string_to_metric_families(text):  # parses only well-formed exposition text
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def sample(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def one_hot(samples: dict, name: str, key: str, **labels) -> str:
    """The state whose sample is 1; exactly one must be."""
    current = [
        dict(k[1])[key]
        for k, v in samples.items()
        if k[0] == name and v == 1 and all(dict(k[1]).get(n) == v2 for n, v2 in labels.items())
    ]
    assert len(current) == 1, (name, labels, current)
    return current[0]


def assert_same_as_the_views(samples: dict, controller) -> None:
    nodes, _ = controller.list_nodes()
    for node in nodes:
        assert (
            one_hot(samples, "motor_controller_node_state", "state", node_id=node.info.node_id)
            == enum_short_name(C.NodeState, node.state).lower()
        )
    instances = controller.list_instances()
    for inst in instances:
        labels = {"instance_id": inst.instance_id, "group": inst.group, "role": role_name(inst.role)}
        assert (
            one_hot(samples, "motor_controller_instance_state", "state", **labels)
            == enum_short_name(C.InstanceState, inst.state).lower()
        )
        for engine in inst.engines:
            ids = {"instance_id": inst.instance_id, "engine_id": engine.engine_id}
            assert (
                one_hot(samples, "motor_controller_engine_health", "health", **ids, node_id=engine.node_id)
                == enum_short_name(T.HealthStatus, engine.health).lower()
            )
            assert sample(samples, "motor_controller_engine_restarts_total", **ids) == engine.restarts
    engines = sum(len(i.engines) for i in instances)
    assert sum(1 for k in samples if k[0] == "motor_controller_engine_restarts_total") == engines
    assert sum(1 for k in samples if k[0] == "motor_controller_node_state") == len(nodes) * 3


# One row per loop turn (the pieces must still join into one valid exposition), and the default.
@pytest.mark.parametrize("chunk", [1, 500])
async def test_the_series_show_what_the_views_show_and_follow_changes(harness, chunk):
    await running_example(harness)
    controller = harness.controller
    series = controller.fleet_series
    series.chunk = chunk
    samples = await scrape(series)
    assert_same_as_the_views(samples, controller)
    assert sample(samples, "motor_controller_silent_nodes_alarm") == 0

    # A state change after the lines were kept shows at the next scrape.
    failed = next(iter(controller.slots.values()))
    engine = harness.client.engines[failed.node_id][failed.engine_id]
    engine.state, engine.health = T.ENGINE_STATE_FAILED, T.HEALTH_STATUS_ABNORMAL
    controller.report_engine_event(failed.node_id, harness.generations[failed.node_id], engine, "exited with code 1")
    node = controller.nodes["node-b"]
    controller.nodes.set_state(node, NODE_SUSPECT, "silent")
    controller.nodes.set_state(node, NODE_LOST, "lost")
    samples = await scrape(series)
    assert_same_as_the_views(samples, controller)
    assert one_hot(samples, "motor_controller_node_state", "state", node_id="node-b") == "lost"
    assert (
        sample(
            samples,
            "motor_controller_engine_restarts_total",
            instance_id=failed.instance_id,
            engine_id=failed.engine_id,
        )
        == controller.slots[failed.engine_id].restarts
        >= 1
    )

    # A removed deployment leaves no engine or instance series behind.
    controller.delete_deployment()
    samples = await scrape(series)
    assert not [k for k in samples if k[0].startswith(("motor_controller_engine_", "motor_controller_instance_"))]


async def test_heartbeat_ages_are_read_at_the_scrape_and_the_alarm_is_one_while_raised(harness):
    await running_example(harness)
    controller = harness.controller
    clock = {"now": controller.nodes["node-a"].last_heartbeat_wall + 5}
    wall = SimpleNamespace(time=lambda: clock["now"])
    series = FleetSeries(controller.state, lambda: controller.monitor.alarm, clock=wall)
    assert abs(sample(await scrape(series), "motor_controller_node_heartbeat_age_seconds", node_id="node-a") - 5) < 0.01
    clock["now"] += 95
    assert (
        abs(sample(await scrape(series), "motor_controller_node_heartbeat_age_seconds", node_id="node-a") - 100) < 0.01
    )
    controller.monitor.alarm = "2 of 2 nodes silent at once"
    assert sample(await scrape(series), "motor_controller_silent_nodes_alarm") == 1


async def test_a_scrape_of_a_large_fleet_lets_the_loop_run_between_pieces(harness):
    await running_example(harness)
    series = harness.controller.fleet_series
    series.chunk = 1
    turns = 0

    async def count_turns():
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.create_task(count_turns())
    await scrape(series)
    counter.cancel()
    assert turns >= len(harness.controller.slots)  # the loop ran at least once per engine row


async def test_discovery_lists_placed_engines_with_their_ids(harness):
    """Its ids, and the deployment and model: what request-level panels and alerts group by."""
    await running_example(harness)
    controller = harness.controller
    targets = engine_targets(controller.state)
    deployment, _ = controller.get_deployment()
    expected = [
        {
            "targets": [f"{e.host}:{e.port}"],
            "labels": {
                "instance_id": i.instance_id,
                "engine_id": e.engine_id,
                "node_id": e.node_id,
                "role": role_name(i.role),
                "deployment": deployment.name,
                "model": deployment.model,
            },
        }
        for i in controller.list_instances()
        for e in i.engines
        if e.host and e.port
    ]
    assert expected and sorted(targets, key=str) == sorted(expected, key=str)


def fleet_tables(nodes: int, ranks: int) -> ClusterState:
    """The controller's tables as a fleet of `nodes` READY nodes leaves them, each running one
    READY instance of `ranks` NORMAL engines, all heard from just now."""
    state = ClusterState(None, EventBus(), SYSTEM_CLOCK)
    now = time.time()
    for n in range(nodes):
        node_id, instance_id = f"node-{n:05d}", f"u-{n:05d}"
        state.nodes.put(NodeRuntime(C.NodeInfo(node_id=node_id), 1, NODE_READY, "", time.monotonic(), now))
        state.instances[instance_id] = InstanceRecord(instance_id, "u", T.ROLE_UNION, ranks, 1, False, "", "", READY)
        for rank in range(ranks):
            state.slots.add(
                EngineSlot(
                    f"{instance_id}/rank{rank}",
                    instance_id,
                    rank,
                    node_id,
                    generation=1,
                    state=T.ENGINE_STATE_RUNNING,
                    health=T.HEALTH_STATUS_NORMAL,
                )
            )
    return state


async def test_a_change_in_a_large_fleet_shows_at_the_next_scrape_and_only_engines_of_live_instances_are_listed():
    state = fleet_tables(1_000, 8)
    series = FleetSeries(state, lambda: "")
    before = await scrape(series)
    assert sum(1 for k in before if k[0] == "motor_controller_engine_restarts_total") == 8_000
    # One row changed in the middle of its block of rows, in each table.
    slot = state.slots["u-00512/rank3"]
    slot.health, slot.restarts, slot.node_id = T.HEALTH_STATUS_ABNORMAL, 2, "node-00999"
    state.instances["u-00250"].state = C.INSTANCE_STATE_RESTARTING
    node = state.nodes["node-00777"]
    state.nodes.set_state(node, NODE_SUSPECT, "silent")
    # Registered again (a new record), not heard from yet.
    replaced = NodeRuntime(C.NodeInfo(node_id="node-00042"), 2, NODE_READY, "", 0.0, 0.0)
    state.nodes.put(replaced)
    after = await scrape(series)
    ids = {"instance_id": "u-00512", "engine_id": "u-00512/rank3"}
    assert one_hot(after, "motor_controller_engine_health", "health", **ids, node_id="node-00999") == "abnormal"
    assert not [
        k
        for k in after
        if k[0] == "motor_controller_engine_health"
        and dict(k[1]).get("node_id") == "node-00512"
        and dict(k[1])["engine_id"] == "u-00512/rank3"
    ]
    assert sample(after, "motor_controller_engine_restarts_total", **ids) == 2
    assert (
        one_hot(after, "motor_controller_instance_state", "state", instance_id="u-00250", group="u", role="union")
        == "restarting"
    )
    assert one_hot(after, "motor_controller_node_state", "state", node_id="node-00777") == "suspect"
    assert ("motor_controller_node_heartbeat_age_seconds", (("node_id", "node-00042"),)) not in after
    assert ("motor_controller_node_heartbeat_age_seconds", (("node_id", "node-00043"),)) in after
    changed = {k for k in after if after[k] != before.get(k)} | {k for k in before if k not in after}
    assert {k[0] for k in changed} - {"motor_controller_node_heartbeat_age_seconds"} <= {
        "motor_controller_engine_health",
        "motor_controller_engine_restarts_total",
        "motor_controller_instance_state",
        "motor_controller_node_state",
    }
    # The engines of an instance that is gone (a deployment change under way) leave; back when it is.
    gone = state.instances.pop("u-00600")
    listed = await scrape(series)
    assert not [k for k in listed if dict(k[1]).get("instance_id") == "u-00600"]
    assert sum(1 for k in listed if k[0] == "motor_controller_engine_restarts_total") == 7_992
    state.instances["u-00600"] = gone
    assert sum(1 for k in await scrape(series) if k[0] == "motor_controller_engine_restarts_total") == 8_000


# A Prometheus in another process: scrapes once per line read, asking for gzip, and prints how many
# engine restart samples it read.
SCRAPER = """
import sys, urllib.request, zlib
for _ in sys.stdin:
    request = urllib.request.Request(sys.argv[1], headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=60) as r:
        body = r.read()
        if r.headers.get("Content-Encoding") == "gzip":
            body = zlib.decompress(body, 16 + zlib.MAX_WBITS)
    print(body.count(b"\\nmotor_controller_engine_restarts_total{"), flush=True)
"""


@pytest.mark.processes
async def test_a_scrape_of_10000_nodes_x_8_engines_leaves_the_loop_to_the_heartbeats():
    """What a Prometheus scrape (every 15 s, always) costs the controller's loop at 10,000 nodes x
    8 engines: a heartbeat-like coroutine, due every millisecond, is never held up long by it, and
    the scrape takes little of the loop's thread in all (0.1-0.15 s here when every row's text
    was joined anew at each scrape, about 40 ms since; bench/metrics_scrape.py measures it in a
    real controller)."""
    state = fleet_tables(10_000, 8)
    telemetry = ServiceTelemetry(CollectorRegistry(), FleetSeries(state, lambda: "").render)
    port = await telemetry.serve("127.0.0.1", free_port())
    scraper = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SCRAPER,
        f"http://127.0.0.1:{port}/metrics",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    held: list[float] = []

    async def heartbeats():
        loop = asyncio.get_running_loop()
        while True:
            due, waited = loop.time() + 0.001, cpu_wait()
            await asyncio.sleep(0.001)
            # How late it ran, less the time the thread waited for a CPU (a loaded machine, not the scrape).
            held.append(loop.time() - due - (cpu_wait() - waited))

    async def scrape_once() -> tuple[int, float]:
        cpu = time.thread_time()  # of the loop's thread: what the scrape took of it
        scraper.stdin.write(b"go\n")
        samples = int(await asyncio.wait_for(scraper.stdout.readline(), 60))
        return samples, time.thread_time() - cpu

    try:
        assert (await scrape_once())[0] == 80_000  # the first scrape after a start makes every row's text
        beating = asyncio.create_task(heartbeats())
        await asyncio.sleep(0.05)
        held.clear()
        assert (await scrape_once())[0] == 80_000
        beating.cancel()
        samples, cpu = await scrape_once()
    finally:
        scraper.stdin.close()
        await scraper.wait()
        await telemetry.close()
    assert samples == 80_000
    assert max(held) < 0.02, f"a heartbeat was held {max(held) * 1e3:.0f} ms during a scrape"
    assert cpu < 0.075, f"a scrape took {cpu * 1e3:.0f} ms of the loop's thread"
