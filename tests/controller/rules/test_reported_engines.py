"""The check of the engines a node reports (controller/rules/deployment_checks.py): every id matched whole,
no control character in text that reaches events, logs, addresses or command lines, the field
named by its place in the report; an engine reported again unchanged is not checked twice."""

from __future__ import annotations

import gc

import pytest

from controller.model import reported
from controller.rules.node_reports import check_reported_engine, check_reported_engines
from motor.errors import InvalidArgument
from motor.v1 import types_pb2
from tests.support import async_wait_for
from tests.support.controller_harness import small_deployment


def engine(
    engine_id: str = "u-0/rank0", node_id: str = "node-a", log_path: str = "/var/log/u-0.log", **spec
) -> types_pb2.Engine:
    fields = dict(instance_id="u-0", host="10.0.0.1", master_dp_ip="10.0.0.1", config_path="")
    fields.update(spec)
    return types_pb2.Engine(
        engine_id=engine_id, node_id=node_id, log_path=log_path, spec=types_pb2.EngineSpec(**fields)
    )


GOOD = engine()
BAD = {  # field as named in the refusal -> an engine whose field is bad
    "engine_id": engine(engine_id="bogus\n/rank0"),
    "node_id": engine(node_id="node-a\n"),
    "log_path": engine(log_path="/tmp/x\x00"),
    "spec.instance_id": engine(instance_id="u-0\r"),
    "spec.host": engine(host="10.0.0.1\x00"),
    "spec.master_dp_ip": engine(master_dp_ip="10.0.0.1\nx"),
    "spec.config_path": engine(config_path="/etc/x\x7f"),
}


def test_good_reports_pass():
    check_reported_engines([])
    check_reported_engines([GOOD, engine("u-1/rank3", instance_id="u-1")])
    check_reported_engine(GOOD, "engines[0]")


@pytest.mark.parametrize("field", sorted(BAD))
def test_a_bad_field_is_refused_by_its_place_in_the_report(field):
    with pytest.raises(InvalidArgument, match=rf"^engines\[1\]\.{field.replace('.', '[.]')} "):
        check_reported_engines([GOOD, BAD[field]])  # the first is fine: the second is named
    with pytest.raises(InvalidArgument, match=rf"^heartbeat\.engines\[0\]\.{field.replace('.', '[.]')} "):
        check_reported_engines([BAD[field]], where="heartbeat.engines")
    with pytest.raises(InvalidArgument, match=rf"^e\.{field.replace('.', '[.]')} "):
        check_reported_engine(BAD[field], "e")


def test_an_engine_reported_again_unchanged_is_not_checked_twice_but_a_changed_one_is():
    # What the node reported before was checked then (here: pretend it held a bad host).
    held = engine(host="10.0.0.1\x00")
    check_reported_engines([held], unchanged={0})  # the same report: skipped
    other = engine("u-1/rank0", instance_id="u-1")
    check_reported_engines([held, other], unchanged={0})  # one skipped, one new and fine
    with pytest.raises(InvalidArgument, match=r"^engines\[1\]\.spec\.host "):
        check_reported_engines([held, engine("u-1/rank0", instance_id="u-1", host="\x00")], unchanged={0})
    with pytest.raises(InvalidArgument, match=r"^engines\[0\]\.spec\.host "):
        check_reported_engines([held, other], unchanged={1})  # only what is unchanged is skipped


def test_the_kept_copy_of_a_report_is_untracked_equal_when_unchanged_and_gives_the_message_back():
    held = engine(config_json='{"motor_engine_union_config": {"engine_type": "sim"}}')
    held.stop_grace.FromSeconds(40)
    wire = held.SerializeToString()
    kept = reported.keep(types_pb2.Engine.FromString(wire))
    assert kept == reported.keep(types_pb2.Engine.FromString(wire))  # the same report again: skipped
    assert reported.keep(types_pb2.Engine.FromString(wire), kept) is kept  # and the kept copy stays
    assert kept[reported.ENGINE_ID] == "u-0/rank0" and kept[reported.STOP_GRACE] == 40.0
    assert reported.message(kept) == held and reported.keep(GOOD)[reported.STOP_GRACE] is None
    gc.collect()
    assert not gc.is_tracked(kept)
    for field, value in (
        ("spec.host", "h"),
        ("log_path", "l"),
        ("node_id", "n"),
        ("spec.config_json", "{}"),
        ("health_reason", "x"),
    ):
        changed = types_pb2.Engine.FromString(wire)
        setattr(changed.spec if field.startswith("spec.") else changed, field.removeprefix("spec."), value)
        assert reported.keep(changed, kept) != kept, field  # checked again


async def test_list_nodes_shows_each_engine_exactly_as_its_node_reported_it(harness):
    # The controller keeps a compact copy of each report (controller/model/reported.py): ListNodes,
    # the stop deadline and a later identical report must see the same engine as before.
    await harness.start()
    await harness.register("node-a")
    harness.controller.apply_deployment(
        small_deployment([{"name": "u", "role": "union", "count": 2, "data_parallel_size": 1}])
    )
    await async_wait_for(lambda: len(harness.client.starts()) == 2, timeout=5, what="2 StartEngine calls")
    harness.client.set_health("node-a")
    for engine in harness.client.report("node-a"):
        engine.health_reason, engine.log_path = "probe ok", f"/var/log/{engine.spec.instance_id}.log"
        engine.stop_grace.FromSeconds(90)
    reported = {e.engine_id: e for e in harness.client.report("node-a")}
    assert all(e.spec.config_json for e in reported.values())
    for _ in range(2):  # the second report is unchanged: the kept copies stay
        harness.beat("node-a")
        nodes, _ = harness.controller.list_nodes()
        assert {e.engine_id: e for e in nodes[0].engines} == reported
    assert harness.controller.actuator.deadline_for("node-a", "u-0/rank0") == 90.0
