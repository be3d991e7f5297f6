"""The controller's fleet aggregates (per deployment, group and state; per node only the nodes
not READY) and Prometheus engine discovery: they show what ListNodes/ListInstances show, follow
changes, and stay small at 10,000 nodes x 8 engines."""

from __future__ import annotations

import time
from types import SimpleNamespace

from controller.fleet.series import FleetSeries, engine_targets
from controller.model.cluster import ClusterState
from controller.model.events import EventBus
from controller.model.instances import READY, InstanceRecord
from controller.model.nodes import NODE_LOST, NODE_READY, NODE_SUSPECT, NodeRuntime
from controller.model.slots import EngineSlot
from motor.clock import SYSTEM_CLOCK
from motor.contract.names import enum_short_name, role_name
from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T
from tests.support.controller_harness import running_example, scrape


def sample(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def group_counts(samples: dict) -> dict[tuple[str, str], int]:
    """(group, state) -> instances, from motor_controller_group_instances (spares included)."""
    counts: dict[tuple[str, str], int] = {}
    for (name, label_pairs), value in samples.items():
        if name == "motor_controller_group_instances":
            key = (dict(label_pairs)["group"], dict(label_pairs)["state"])
            counts[key] = counts.get(key, 0) + int(value)
    return counts


def assert_same_as_the_views(samples: dict, controller) -> None:
    instances = controller.list_instances()
    expected: dict[tuple[str, str], int] = {}
    for inst in instances:
        key = (inst.group, enum_short_name(C.InstanceState, inst.state).lower())
        expected[key] = expected.get(key, 0) + 1
    assert {k: v for k, v in group_counts(samples).items() if v} == expected
    nodes, _ = controller.list_nodes()
    unready = {
        (node.info.node_id, enum_short_name(C.NodeState, node.state).lower())
        for node in nodes
        if node.state != C.NODE_STATE_READY
    }
    listed = {
        (dict(k[1])["node_id"], dict(k[1])["state"])
        for k, v in samples.items()
        if k[0] == "motor_controller_node_unready" and v == 1
    }
    assert listed == unready
    # Nothing per engine or per instance: that is the node managers' (and `motorctl instances`').
    assert not [k for k in samples if "engine_id" in dict(k[1]) or "instance_id" in dict(k[1])]


async def test_the_aggregates_show_what_the_views_show_and_follow_changes(harness):
    await running_example(harness)
    controller = harness.controller
    series = controller.fleet_series
    samples = await scrape(series)
    assert_same_as_the_views(samples, controller)
    assert sample(samples, "motor_controller_silent_nodes_alarm") == 0
    assert not [k for k in samples if k[0] == "motor_controller_node_unready"]  # every node READY: no line
    assert not [k for k in samples if k[0] == "motor_controller_group_not_ready_seconds"]
    prefill = dict(deployment="local-sim", group="prefill", role="prefill", spare="false")
    assert sample(samples, "motor_controller_group_instances", **prefill, state="ready") == 1
    assert sample(samples, "motor_controller_group_instances", **prefill, state="pending") == 0

    # An engine fails and a node is lost: both show at the next scrape.
    failed = next(iter(controller.slots.values()))
    engine = harness.client.engines[failed.node_id][failed.engine_id]
    engine.state, engine.health = T.ENGINE_STATE_FAILED, T.HEALTH_STATUS_ABNORMAL
    controller.report_engine_event(failed.node_id, harness.generations[failed.node_id], engine, "exited with code 1")
    node = controller.nodes["node-b"]
    controller.nodes.set_state(node, NODE_SUSPECT, "silent")
    controller.nodes.set_state(node, NODE_LOST, "lost")
    samples = await scrape(series)
    assert_same_as_the_views(samples, controller)
    assert sample(samples, "motor_controller_node_unready", node_id="node-b", state="lost") == 1
    inst = controller.instances[failed.instance_id]
    assert inst.state != READY
    group = dict(
        deployment="local-sim",
        group=inst.group,
        role=role_name(inst.role),
        spare="false",
        state=enum_short_name(C.InstanceState, inst.state).lower(),
    )
    assert 0 <= sample(samples, "motor_controller_group_not_ready_seconds", **group) < 60

    # A removed deployment leaves no group series behind.
    controller.delete_deployment()
    samples = await scrape(series)
    assert not [k for k in samples if k[0].startswith("motor_controller_group_")]


async def test_ages_are_read_at_the_scrape_and_the_alarm_is_one_while_raised(harness):
    await running_example(harness)
    controller = harness.controller
    oldest = min(n.last_heartbeat_wall for n in controller.nodes.values())
    clock = {"now": oldest + 5}
    wall = SimpleNamespace(time=lambda: clock["now"])
    series = FleetSeries(controller.state, lambda: controller.monitor.alarm, clock=wall)
    assert abs(sample(await scrape(series), "motor_controller_node_heartbeat_age_max_seconds") - 5) < 0.01
    clock["now"] += 95
    assert abs(sample(await scrape(series), "motor_controller_node_heartbeat_age_max_seconds") - 100) < 0.01
    # A lost node's silence is no news: the age is of the nodes expected to heartbeat.
    for node in controller.nodes.values():
        if node.last_heartbeat_wall == oldest:
            controller.nodes.set_state(node, NODE_SUSPECT, "silent")
            controller.nodes.set_state(node, NODE_LOST, "lost")
    assert sample(await scrape(series), "motor_controller_node_heartbeat_age_max_seconds") <= 100
    # An instance not ready: its group's age in that state is read at the scrape too.
    inst = next(iter(controller.instances.values()))
    controller.state.transition(inst, C.INSTANCE_STATE_DEGRADED, "a rank is abnormal")
    inst.state_changed_at = clock["now"] - 700
    group = dict(deployment="local-sim", group=inst.group, role=role_name(inst.role), spare="false", state="degraded")
    assert abs(sample(await scrape(series), "motor_controller_group_not_ready_seconds", **group) - 700) < 0.01
    controller.monitor.alarm = "2 of 2 nodes silent at once"
    assert sample(await scrape(series), "motor_controller_silent_nodes_alarm") == 1


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


async def test_a_scrape_of_10000_nodes_x_8_engines_is_small_and_names_only_the_nodes_not_ready():
    """The controller's scrape at 10,000 nodes x 8 engines (bench/fleet_scrape.py times it): a few
    kilobytes, not 41 MiB; a node that is not READY has its line, the others none."""
    state = fleet_tables(10_000, 8)
    node = state.nodes["node-00777"]
    state.nodes.set_state(node, NODE_SUSPECT, "silent")
    text = b"".join([piece async for piece in FleetSeries(state, lambda: "").render()])
    assert len(text) < 1 << 20, f"{len(text)} bytes"
    samples = await scrape(FleetSeries(state, lambda: ""))
    assert [dict(k[1]) for k in samples if k[0] == "motor_controller_node_unready"] == [
        {"node_id": "node-00777", "state": "suspect"}
    ]
    ready = dict(deployment="", group="u", role="union", spare="false", state="ready")
    assert sample(samples, "motor_controller_group_instances", **ready) == 10_000
