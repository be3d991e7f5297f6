"""WatchEngines feed of NodeManager: a watcher that falls behind is ended, not silently starved."""

from __future__ import annotations

import pytest

from motor.errors import ResourceExhausted
from motor.v1 import types_pb2
from node_manager.config import NodeManagerConfig
from node_manager.engine import EngineRecord
from node_manager.manager import NodeManager


async def test_a_watcher_that_falls_behind_gets_resource_exhausted(tmp_path):
    manager = NodeManager(NodeManagerConfig(node_id="node-w", state_dir=str(tmp_path)))
    record = EngineRecord(
        spec=types_pb2.EngineSpec(instance_id="x-0"), requested=types_pb2.EngineSpec(), log_path="x.log", token="t"
    )
    manager.records[record.engine_id] = record
    feed = manager.watch()
    engine, snapshot = await feed.__anext__()
    assert engine.engine_id == "x-0/rank0" and snapshot
    manager._publish(record)
    engine, snapshot = await feed.__anext__()
    assert engine.engine_id == "x-0/rank0" and not snapshot
    for _ in range(10001):
        manager._publish(record)
    with pytest.raises(
        ResourceExhausted, match="WatchEngines: subscriber too slow: more than 10000 messages queued; reconnect"
    ):
        await feed.__anext__()
    assert not manager._watchers
