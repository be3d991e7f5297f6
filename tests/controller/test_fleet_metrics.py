"""The controller's fleet series (rendered from its tables, kept as text between scrapes) and
Prometheus engine discovery: they show what ListNodes/ListInstances show, and follow changes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from controller.fleet_metrics import FleetSeries, engine_targets
from controller.nodes import NODE_LOST, NODE_SUSPECT
from motor.contract.names import enum_short_name, role_name
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


async def test_the_series_show_what_the_views_show_and_follow_changes(harness):
    await running_example(harness)
    controller = harness.controller
    series = controller.fleet_series
    series.chunk = 1  # one row per loop turn: the pieces must still join into one valid exposition
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
    await running_example(harness)
    controller = harness.controller
    targets = engine_targets(controller.state)
    expected = [
        {
            "targets": [f"{e.host}:{e.port}"],
            "labels": {
                "instance_id": i.instance_id,
                "engine_id": e.engine_id,
                "node_id": e.node_id,
                "role": role_name(i.role),
            },
        }
        for i in controller.list_instances()
        for e in i.engines
        if e.host and e.port
    ]
    assert expected and sorted(targets, key=str) == sorted(expected, key=str)
