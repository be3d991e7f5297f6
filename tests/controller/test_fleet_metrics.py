"""The controller's fleet series and Prometheus engine discovery, from ListNodes/ListInstances views."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp
from prometheus_client import CollectorRegistry

from controller.fleet_metrics import FleetCollector, engine_targets
from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T


def views():
    nodes = [
        C.Node(info=C.NodeInfo(node_id="node-a"), state=C.NODE_STATE_READY, last_heartbeat=Timestamp(seconds=995)),
        C.Node(info=C.NodeInfo(node_id="node-b"), state=C.NODE_STATE_LOST, last_heartbeat=Timestamp(seconds=900)),
    ]
    instances = [
        C.Instance(
            instance_id="decode-0", group="decode", role=T.ROLE_DECODE, state=C.INSTANCE_STATE_READY,
            engines=[C.InstanceEngine(engine_id="decode-0/rank0", node_id="node-a", host="10.0.0.1", port=20001,
                                      health=T.HEALTH_STATUS_NORMAL, restarts=2)],
        ),
        C.Instance(
            instance_id="prefill-0", group="prefill", role=T.ROLE_PREFILL, state=C.INSTANCE_STATE_PENDING,
            engines=[C.InstanceEngine(engine_id="prefill-0/rank0")],  # not placed yet
        ),
    ]
    return nodes, instances


def registry(alarms: list[str]) -> CollectorRegistry:
    nodes, instances = views()
    reg = CollectorRegistry()
    reg.register(FleetCollector(lambda: (nodes, alarms), lambda: instances, clock=lambda: 1000.0))
    return reg


def test_states_are_one_hot_and_ages_come_from_the_last_heartbeat():
    reg = registry([])
    value = reg.get_sample_value
    assert value("motor_controller_node_state", {"node_id": "node-b", "state": "lost"}) == 1
    assert value("motor_controller_node_state", {"node_id": "node-b", "state": "ready"}) == 0
    assert value("motor_controller_node_state", {"node_id": "node-a", "state": "ready"}) == 1
    assert value("motor_controller_node_heartbeat_age_seconds", {"node_id": "node-a"}) == 5
    assert value("motor_controller_node_heartbeat_age_seconds", {"node_id": "node-b"}) == 100
    assert value("motor_controller_silent_nodes_alarm", {}) == 0
    pending = {"instance_id": "prefill-0", "group": "prefill", "role": "prefill"}
    assert value("motor_controller_instance_state", {**pending, "state": "pending"}) == 1
    assert value("motor_controller_instance_state", {**pending, "state": "ready"}) == 0
    engine = {"instance_id": "decode-0", "engine_id": "decode-0/rank0"}
    assert value("motor_controller_engine_health", {**engine, "node_id": "node-a", "health": "normal"}) == 1
    assert value("motor_controller_engine_restarts_total", engine) == 2


def test_the_alarm_is_one_while_raised():
    assert registry(["3 of 4 nodes silent at once"]).get_sample_value("motor_controller_silent_nodes_alarm", {}) == 1


def test_discovery_lists_placed_engines_with_their_ids():
    _, instances = views()
    assert engine_targets(lambda: instances) == [
        {"targets": ["10.0.0.1:20001"],
         "labels": {"instance_id": "decode-0", "engine_id": "decode-0/rank0", "node_id": "node-a", "role": "decode"}}
    ]
