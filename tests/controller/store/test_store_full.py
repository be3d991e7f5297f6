"""The controller's disk full, replayed by a write-failure injection at the
store boundary: every write statement of the SQLite store fails with the error SQLite gives on a
full disk (`sqlite3.OperationalError: database or disk is full`), through the store's own error
handling. (A real full tmpfs needs root to mount; the chaos suite uses one where it can.)"""

from __future__ import annotations

import asyncio

import pytest

from motor.errors import Unavailable
from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T
from tests.support import async_wait_for
from tests.support.controller_harness import running_example, small_deployment
from tests.support.full_disk import fill_disk, free_disk


async def test_apply_on_a_full_disk_is_unavailable_and_changes_nothing(harness):
    await running_example(harness)
    ctl, client = harness.controller, harness.client
    fill_disk(harness.store)
    bigger = small_deployment(
        [{"name": "other", "role": "union", "count": 300}], name="local-sim"
    )  # the same deployment, changed
    with pytest.raises(Unavailable, match="database or disk is full"):
        ctl.apply_deployment(bigger)
    assert ctl.revision == 1 and ctl.get_deployment()[0].name == "local-sim"
    assert set(ctl.instances) == {"prefill-0", "decode-0"} and not client.stops()
    with pytest.raises(Unavailable, match="database or disk is full"):
        ctl.delete_deployment()
    assert ctl.revision == 1 and set(ctl.instances) == {"prefill-0", "decode-0"} and not client.stops()
    refused = ctl.metrics.registry.get_sample_value(
        "motor_controller_store_write_failures_total", {"operation": "transaction"}
    )
    assert refused == 2
    assert any(e.type == C.EVENT_TYPE_ALARM and "store is failing" in e.message for e in ctl.events.recent)
    free_disk(harness.store)
    _, revision = ctl.apply_deployment(bigger)
    assert revision == 2 and "other-0" in ctl.instances
    # What memory says is what the disk says.
    stored = harness.store.load()
    assert stored.revision == 2 and set(stored.instances) == set(ctl.instances)


async def test_an_engine_failure_on_a_full_disk_is_restarted_once_space_returns_nothing_stranded(harness):
    await running_example(harness, initial_backoff=0.2)
    ctl, client = harness.controller, harness.client
    node_id = next(n for n, engines in client.engines.items() if "decode-0/rank0" in engines)
    before = len(client.starts("decode-0/rank0"))
    fill_disk(harness.store)
    dead = client.engines[node_id]["decode-0/rank0"]
    dead.state = T.ENGINE_STATE_FAILED
    ctl.report_engine_event(node_id, harness.generations[node_id], dead, "killed by signal 9 (SIGKILL)")
    # The failure is handled in memory although the disk refuses it: RESTARTING, said by an alarm.
    inst = harness.instance("decode-0")
    assert inst.state == C.INSTANCE_STATE_RESTARTING and len(inst.failure_times) == 1
    await async_wait_for(
        lambda: any(e.type == C.EVENT_TYPE_ALARM and "store is failing" in e.message for e in ctl.events.recent),
        timeout=5,
        what="the store alarm",
    )
    # A restart needs a generation stored first: it waits for the disk, re-armed by the reconcile loop.
    await asyncio.sleep(1.0)
    assert len(client.starts("decode-0/rank0")) == before and inst.state == C.INSTANCE_STATE_RESTARTING
    free_disk(harness.store)
    await async_wait_for(
        lambda: len(client.starts("decode-0/rank0")) == before + 1, timeout=10, what="the restart once space returned"
    )
    await async_wait_for(
        lambda: harness.store.load().instances["decode-0"]["restarts"] == 1, timeout=10, what="the refused writes saved"
    )
    assert harness.store.load().assignments["decode-0/rank0"]["generation"] == ctl.slots["decode-0/rank0"].generation
    assert len(harness.store.load().instances["decode-0"]["failure_times"]) == 1
    assert any("accepts writes again" in e.message for e in ctl.events.recent)
