"""The controller's own measurements: store writes (any store), time from an engine's failure to
its replacement NORMAL, and moves held back by the reschedule rate limit."""

from __future__ import annotations

import contextlib

import pytest

from controller.store.interface import StoreUnavailable
from controller.store.sqlite import SqliteStore
from controller.store.write_metrics import MeasuredStore, StoreMetrics
from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T
from tests.support import async_wait_for
from tests.support.controller_harness import Harness, running_example, small_deployment


def value(metrics: StoreMetrics, name: str, operation: str) -> float:
    sample = {
        "seconds": "motor_controller_store_write_seconds_count",
        "failures": "motor_controller_store_write_failures_total",
    }
    collector = metrics.seconds if name == "seconds" else metrics.failures
    for family in collector.collect():
        for s in family.samples:
            if s.name == sample[name] and s.labels["operation"] == operation:
                return s.value
    raise AssertionError(f"no {name} sample for {operation}")


def test_store_writes_are_timed_and_failures_counted(tmp_path):
    metrics = StoreMetrics()
    store = MeasuredStore(SqliteStore(str(tmp_path / "c.db")), metrics)
    store.save_instance("decode-0", {"a": 1})
    with store.transaction():
        store.save_instance("decode-1", {"a": 2})
        store.delete_instance("decode-0")
    assert value(metrics, "seconds", "write") == 1  # the single write outside a transaction
    assert value(metrics, "seconds", "transaction") == 1  # the block, once, not its two writes
    assert set(store.load().instances) == {"decode-1"}

    # An error of the block rolls back: not the store's failure.
    with pytest.raises(KeyError):
        with store.transaction():
            store.save_instance("decode-2", {})
            raise KeyError("controller bug")
    assert value(metrics, "failures", "transaction") == 0
    assert "decode-2" not in store.load().instances

    store.close()  # the database is gone: every write now fails, and is counted
    with pytest.raises(StoreUnavailable):
        store.save_instance("decode-3", {})
    with pytest.raises(StoreUnavailable):
        with store.transaction():
            store.save_instance("decode-4", {})
    assert value(metrics, "failures", "write") == 1
    assert value(metrics, "failures", "transaction") == 1  # it could not even begin
    with contextlib.suppress(Exception):
        store.close()


def recovery_count(harness: Harness) -> float:
    return harness.controller.metrics.registry.get_sample_value("motor_controller_engine_recovery_seconds_count") or 0


async def test_time_from_failure_to_replacement_normal_is_observed_once(harness):
    await running_example(harness)
    ctl, client = harness.controller, harness.client
    node_id = next(n for n, e in client.engines.items() if "decode-0/rank0" in e)
    failed = client.engines[node_id]["decode-0/rank0"]
    failed.state = T.ENGINE_STATE_FAILED
    ctl.report_engine_event(node_id, harness.generations[node_id], failed, "exited with code 1")
    await async_wait_for(lambda: len(client.starts("decode-0/rank0")) == 2, timeout=5, what="the restart")
    harness.beat(node_id)  # the replacement is starting: not recovered yet
    assert recovery_count(harness) == 0
    client.set_health(node_id)
    harness.beat(node_id)
    assert recovery_count(harness) == 1
    harness.beat(node_id)  # NORMAL again and again is one recovery
    assert recovery_count(harness) == 1
    assert harness.instance("decode-0").state == C.INSTANCE_STATE_READY


async def test_moves_held_back_by_the_rate_limit_are_counted_once_per_hold_back(tmp_path):
    harness = Harness(tmp_path, reschedule_rate=0.01)
    try:
        await harness.start()
        for node in ("node-a", "node-b"):
            await harness.register(node, accelerators=2)
        groups = [
            {"name": "decode", "role": "decode", "count": 2, "data_parallel_size": 1, "accelerators_per_engine": 1}
        ]
        harness.controller.apply_deployment(small_deployment(groups))
        await async_wait_for(lambda: len(harness.client.starts()) == 2, timeout=5, what="2 StartEngine calls")
        ctl = harness.controller
        # The engines of one node are taken off it as a node loss does, with the bucket spent.
        victim = next(iter(harness.client.engines))
        moved = [s for s in ctl.slots.values() if s.node_id == victim]
        ctl.scheduler.reschedule_bucket.tokens = 0
        ctl.scheduler.reschedule_bucket.capacity = 10  # (so that a full bucket is not reached meanwhile)
        for slot in moved:
            ctl.state.unplace(slot)
        ctl.scheduler.reconcile_once()
        ctl.scheduler.reconcile_once()  # still held back: not counted again
        held = ctl.metrics.registry.get_sample_value("motor_controller_reschedules_rate_limited_total")
        assert held == len(moved) > 0
        assert any("reschedule rate limit" in i.reason for i in ctl.instances.values())
    finally:
        await harness.stop()
