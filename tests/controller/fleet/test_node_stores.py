"""A node manager's full disk reaches the operator ("a metric and an
event"): its heartbeats carry `store_failing`; the controller raises one ALARM event for the
spell whose count grows per heartbeat, and one when it ends. The real node manager's side is in
tests/node_manager/test_disk_full.py, the whole path on a real full tmpfs in tests/chaos."""

from __future__ import annotations

import pytest

from controller.fleet.node_stores import SETTLE_BEATS
from motor.errors import InvalidArgument
from motor.v1 import controller_pb2 as C

FULL = "engine records cannot be written in /var/lib/motor/engines (No space left on device)"


def alarms(controller, words: str) -> list[C.Event]:
    return [e for e in controller.events.recent if e.type == C.EVENT_TYPE_ALARM and words in e.message]


async def test_a_failing_node_store_is_one_alarm_with_a_count_then_one_when_it_ends(harness):
    await harness.start()
    await harness.register("node-a")
    await harness.register("node-b")
    ctl, generation = harness.controller, harness.generations["node-a"]
    for _ in range(3):
        ctl.heartbeat("node-a", generation, [], delta=True, store_failing=FULL)
        ctl.heartbeat("node-b", harness.generations["node-b"], [], delta=True)
    [raised] = alarms(ctl, "No space left on device")
    assert raised.node_id == "node-a" and raised.count == 3 and raised.message.startswith(f"node node-a: {FULL}")
    assert "free space" in raised.message
    for _ in range(SETTLE_BEATS - 1):  # not over yet: a flapping disk stays one event (below)
        ctl.heartbeat("node-a", generation, [], delta=True)
    assert not alarms(ctl, "written again")
    ctl.heartbeat("node-a", generation, [], delta=True)
    [cleared] = alarms(ctl, "written again")
    assert cleared.node_id == "node-a" and f"{SETTLE_BEATS} heartbeats in a row" in cleared.message
    assert "said in 3 heartbeat(s)" in cleared.message
    assert len(alarms(ctl, "node-b")) == 0 and len(alarms(ctl, "No space left")) == 1
    # A later spell is a new event.
    ctl.heartbeat("node-a", generation, [], store_failing=FULL)
    assert [e.count for e in alarms(ctl, "No space left")] == [3, 1]


async def test_a_store_failing_text_with_a_control_character_is_refused(harness):
    await harness.start()
    await harness.register("node-a")
    with pytest.raises(InvalidArgument, match=r"^store_failing 'disk\\nfull' holds the control character"):
        harness.controller.heartbeat("node-a", harness.generations["node-a"], [], store_failing="disk\nfull")
    assert not alarms(harness.controller, "disk")


async def test_a_store_failing_that_flaps_every_beat_is_one_event_with_a_count(harness):
    await harness.start()
    await harness.register("node-a")
    ctl, generation = harness.controller, harness.generations["node-a"]
    before = len(ctl.events.recent)
    for _ in range(200):  # a disk at the brink: full, freed by a log rotation, full again...
        ctl.heartbeat("node-a", generation, [], delta=True, store_failing=FULL)
        ctl.heartbeat("node-a", generation, [], delta=True)
    [raised] = alarms(ctl, "No space left on device")
    assert raised.count == 200 and not alarms(ctl, "written again")
    assert len(ctl.events.recent) == before + 1  # the history keeps the other events
