"""A group's instances spread across nodes: two instances on two empty nodes went both to
node-a, so that node's loss took the model down (the rule: tests/controller/test_spread_rules.py)."""

from __future__ import annotations

from collections import Counter

from tests.support import async_wait_for
from tests.support.controller_harness import small_deployment


async def test_instances_of_a_group_go_to_different_nodes_while_others_have_room(harness):
    await harness.start()
    for node in ("node-a", "node-b"):
        await harness.register(node, accelerators=4)
    harness.controller.apply_deployment(small_deployment([{"name": "u", "role": "union", "count": 3}]))
    await async_wait_for(lambda: len(harness.client.starts()) == 3, timeout=5, what="3 StartEngine calls")
    by_node = Counter(call[1] for call in harness.client.calls if call[0] == "start")
    assert sorted(by_node.values()) == [1, 2], by_node  # 2 + 1, not 3 + 0
