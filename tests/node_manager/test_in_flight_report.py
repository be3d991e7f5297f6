"""A node manager reports each engine's requests in flight, as its engine server last said, in the
heartbeat (the controller's autoscaler reads it): a change goes out in the next delta."""

from __future__ import annotations

from motor.v1 import types_pb2
from node_manager.engine import RUNNING, EngineRecord
from node_manager.heartbeat_deltas import HeartbeatDeltas
from tests.support.node_manager_fakes import sim_spec


def test_the_in_flight_count_of_a_status_is_reported_and_a_change_is_in_the_next_delta():
    record = EngineRecord(spec=sim_spec(), requested=sim_spec(), log_path="/nonexistent", token="t", state=RUNNING)
    deltas = HeartbeatDeltas("node-a")
    record.observe_status(types_pb2.EngineStatus(in_flight_requests=7))
    first = deltas.next(1, [record.to_proto("node-a")])
    assert [e.in_flight_requests for e in first.engines] == [7]
    assert not deltas.next(1, [record.to_proto("node-a")]).engines  # nothing changed: not sent again
    record.observe_status(types_pb2.EngineStatus(in_flight_requests=3))
    assert [e.in_flight_requests for e in deltas.next(1, [record.to_proto("node-a")]).engines] == [3]


def test_the_average_in_flight_of_a_status_is_reported_and_left_unset_by_an_engine_that_has_none():
    record = EngineRecord(spec=sim_spec(), requested=sim_spec(), log_path="/nonexistent", token="t", state=RUNNING)
    record.observe_status(types_pb2.EngineStatus(in_flight_requests=2, in_flight_average=1.35))
    assert record.to_proto("node-a").in_flight_average == 1.35
    record.observe_status(types_pb2.EngineStatus(in_flight_requests=2))  # an engine server before the average
    assert not record.to_proto("node-a").HasField("in_flight_average")
