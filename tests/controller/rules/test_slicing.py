"""Long work in slices (controller/rules/slicing.py), the incremental placement view
(controller/capacity/fleet_view.py) and sliced deployment changes (controller/deploy/changes.py), in process:
a change yields to the loop while it runs, is answered only once durable and made, refuses a
full disk without touching memory, and two changes run one after the other."""

from __future__ import annotations

import asyncio
import random

import pytest

from controller.capacity.fleet_view import FleetView
from controller.model.nodes import NODE_SUSPECT
from controller.rules.placement import Fleet, NodeCapacity, place_instance
from controller.rules.slicing import Budget, in_slices, run_at_once, run_sliced
from motor.errors import Unavailable
from tests.support.controller_harness import small_deployment
from tests.support.full_disk import fill_disk, free_disk


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_budget_yields_once_its_time_or_its_spawns_are_spent():
    clock = Clock()
    budget = Budget(seconds=0.02, spawns=3, clock=clock)
    assert run_at_once(budget.checkpoint()) is False
    clock.now = 0.02
    steps = budget.checkpoint()
    next(steps)  # spent: it yields
    clock.now = 0.03
    with pytest.raises(StopIteration) as done:
        next(steps)
    assert done.value.value is True and budget.began == 0.03  # the next slice starts on resume
    for _ in range(2):
        budget.spawned()
    assert not budget.spent()
    budget.spawned()
    assert budget.spent()


def test_in_slices_does_every_item_once_and_closes_each_slice_before_it_yields():
    clock, done, slices = Clock(), [], []

    class Slice:
        def __enter__(self):
            slices.append("open")

        def __exit__(self, *exc):
            slices.append("closed")

    def work(item):
        done.append(item)
        clock.now += 0.01

    steps = in_slices(range(7), work, Budget(seconds=0.02, clock=clock), Slice)
    yields = 0
    for _ in steps:
        yields += 1
        assert slices[-1] == "closed"
    assert done == list(range(7)) and yields == 3
    assert slices == ["open", "closed"] * 4


async def test_run_sliced_lets_the_loop_run_between_slices_and_returns_the_result():
    ticks = []

    async def ticker():
        while True:
            ticks.append(1)
            await asyncio.sleep(0)

    def work():
        for _ in range(5):
            yield
        return "done"

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    assert await run_sliced(work()) == "done"
    task.cancel()
    assert len(ticks) >= 5


# ------------------------------------------------------------------ the fleet kept between passes


async def test_the_fleet_view_reads_only_what_changed_and_matches_a_fresh_rebuild(harness):
    ctl = await harness.start()
    for node in ("node-a", "node-b", "node-c"):
        await harness.register(node, accelerators=8)
    st = ctl.state
    view = FleetView(st)

    def fresh() -> dict:
        return {k: (sorted(n.used_accelerators), n.ports_in_use) for k, n in FleetView(st).fleet().nodes.items()}

    def kept() -> dict:
        return {k: (sorted(n.used_accelerators), n.ports_in_use) for k, n in view.fleet().nodes.items()}

    assert kept() == fresh() and len(kept()) == 3
    assert not st.slots.room_changed and not st.nodes.room_changed  # read: nothing pending
    ctl.apply_deployment(small_deployment([{"name": "u", "role": "union", "count": 5, "data_parallel_size": 2}]))
    ctl.reconcile_once()
    assert kept() == fresh()
    rng = random.Random(5)
    for _ in range(20):  # moves, removals and a lost node, each compared with a rebuild
        slot = rng.choice([s for s in st.slots.values() if s.node_id] or [None])
        if slot is not None:
            st.unplace(slot)
        ctl.reconcile_once()
        assert kept() == fresh()
    node = st.nodes["node-b"]
    st.nodes.set_state(node, NODE_SUSPECT, "test")
    assert "node-b" not in kept() and kept() == fresh()


async def test_the_fleet_view_counts_a_kv_events_port_for_every_engine_of_a_kv_events_controller(harness):
    ctl = await harness.start()
    await harness.register("node-a", accelerators=8)
    st = ctl.state
    ctl.apply_deployment(small_deployment([{"name": "u", "role": "union", "count": 2}]))
    ctl.reconcile_once()
    placed = sum(1 for s in st.slots.values() if s.node_id == "node-a")
    assert placed == 2
    assert FleetView(st).fleet().nodes["node-a"].ports_in_use == 2 * placed
    assert FleetView(st, kv_events=True).fleet().nodes["node-a"].ports_in_use == 3 * placed


def test_placement_with_a_kept_fleet_takes_what_it_places():
    fleet = Fleet([NodeCapacity("a", "h", list(range(4)))])
    place_instance([0, 1], 1, False, fleet)
    assert fleet.order[0][0] == 2


# ------------------------------------------------------------------ deployment changes in slices


async def _ticking(during):
    """How many times a task got the loop while `during` ran."""
    ticks = 0
    stop = False

    async def ticker():
        nonlocal ticks
        while not stop:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    try:
        result = await during
    finally:
        stop = True
        await task
    return result, ticks


async def test_a_big_apply_yields_to_the_loop_and_is_answered_durable_and_complete(harness):
    ctl = await harness.start()
    await harness.register("node-a", accelerators=4)
    big = small_deployment([{"name": "u", "role": "union", "count": 3000, "data_parallel_size": 2}])
    (deployment, revision), ticks = await _ticking(ctl.apply(big))
    assert revision == 1 and deployment.instance_groups[0].count == 3000
    assert ticks > 5, "the apply held the loop from start to end"
    assert len(ctl.instances) == 3000 and len(ctl.slots) == 6000  # answered once made in memory
    stored = harness.store.load()  # and durable
    assert stored.revision == 1 and len(stored.instances) == 3000 and len(stored.assignments) == 6000
    # Replacing every instance at once (strategy recreate), then deleting: each answered complete.
    changed = small_deployment(
        [{"name": "u", "role": "union", "count": 2000, "data_parallel_size": 3}], strategy={"type": "recreate"}
    )
    (_, revision), ticks = await _ticking(ctl.apply(changed))
    assert revision == 2 and len(ctl.instances) == 2000 and len(ctl.slots) == 6000 and ticks > 5
    assert all(inst.data_parallel_size == 3 for inst in ctl.instances.values())
    assert len(harness.store.load().assignments) == 6000
    _, ticks = await _ticking(ctl.delete())
    assert not ctl.instances and not ctl.slots and ctl.deployment is None and ticks > 5
    stored = harness.store.load()
    assert stored.deployment is None and not stored.instances and not stored.assignments


async def test_a_sliced_apply_on_a_full_disk_is_unavailable_and_changes_nothing(harness):
    ctl = await harness.start()
    await harness.register("node-a", accelerators=4)
    await ctl.apply(small_deployment([{"name": "u", "role": "union", "count": 2}]))
    fill_disk(harness.store)
    with pytest.raises(Unavailable, match="database or disk is full"):
        await ctl.apply(small_deployment([{"name": "v", "role": "union", "count": 500}]))
    with pytest.raises(Unavailable, match="database or disk is full"):
        await ctl.delete()
    assert ctl.revision == 1 and set(ctl.instances) == {"u-0", "u-1"}
    assert not ctl.store.busy
    free_disk(harness.store)
    _, revision = await ctl.apply(small_deployment([{"name": "v", "role": "union", "count": 500}]))
    assert revision == 2 and len(ctl.instances) == 500 and len(harness.store.load().instances) == 500


async def test_changes_run_one_after_the_other_and_the_last_one_wins(harness):
    ctl = await harness.start()
    await harness.register("node-a", accelerators=4)
    first = asyncio.ensure_future(ctl.apply(small_deployment([{"name": "u", "role": "union", "count": 2000}])))
    second = asyncio.ensure_future(ctl.apply(small_deployment([{"name": "v", "role": "union", "count": 1000}])))
    (_, r1), (_, r2) = await asyncio.gather(first, second)
    assert (r1, r2) == (1, 2)
    assert set(ctl.instances) == {f"v-{i}" for i in range(1000)}
    assert set(harness.store.load().instances) == set(ctl.instances)


async def test_writes_wait_while_the_store_is_busy_with_a_big_write(harness):
    ctl = await harness.start()
    await harness.register("node-a", accelerators=4)
    st = ctl.state
    harness.store.busy = True
    st.save_node(st.nodes["node-a"])
    assert st.flush() is False and st.unsaved["nodes"] == {"node-a"}
    ctl.reconcile_once()  # skipped: placing would wait for the store
    harness.store.busy = False
    assert st.flush() is True and not st.unsaved["nodes"]


async def test_writes_of_one_loop_turn_go_out_as_one_transaction(harness):
    ctl = await harness.start()
    await harness.register("node-a", accelerators=4)
    await harness.register("node-b", accelerators=4)
    seconds = ctl.store.metrics.seconds
    before = seconds.labels("transaction")._sum.get(), sum(b.get() for b in seconds.labels("transaction")._buckets)
    for node in ("node-a", "node-b"):
        ctl.state.save_node(ctl.state.nodes[node])
    assert ctl.state.unsaved["nodes"] == {"node-a", "node-b"}  # not yet: at the end of this turn
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not ctl.state.unsaved["nodes"]
    after = sum(b.get() for b in seconds.labels("transaction")._buckets)
    assert after - before[1] == 1


async def test_the_write_behind_never_undoes_rows_a_change_wrote_while_memory_catches_up(harness, monkeypatch):
    """Rows changed before a change (a placement) are flushed between its slices: they must not
    write back the old instance's rows, nor delete the new rows of a replaced instance before it
    is installed again."""
    from controller.deploy import changes as deployments

    ctl = await harness.start()
    await harness.register("node-a", accelerators=4)
    ctl.apply_deployment(small_deployment([{"name": "u", "role": "union", "count": 3, "data_parallel_size": 2}]))
    ctl.reconcile_once()  # u-0 and u-1 placed, u-2 waits: their rows are written behind
    st = ctl.state
    monkeypatch.setattr(deployments, "Budget", lambda: Budget(seconds=0.0))  # a slice per item
    changes = ctl.changes
    plan = run_at_once(
        changes._plan(
            deployments.validate_deployment(
                small_deployment(
                    [{"name": "u", "role": "union", "count": 2, "data_parallel_size": 3}], strategy={"type": "recreate"}
                ),
                1000,
            )
        )
    )
    for instance_id in ("u-0", "u-1", "u-2"):  # rows changed just before the change: unsaved
        st.unsaved["instances"].add(instance_id)
        st.unsaved["slots"].update(s.engine_id for s in st.slots_of(instance_id))
    changes._persist(plan, changes._store_change(plan))
    for _ in changes._change_memory(plan):
        assert st.flush()  # between every two slices
    stored = harness.store.load()
    assert set(stored.instances) == {"u-0", "u-1"} and stored.instances["u-0"]["data_parallel_size"] == 3
    assert set(stored.assignments) == {f"u-{n}/rank{r}" for n in range(2) for r in range(3)}


async def test_instances_a_change_removes_are_not_placed_while_it_removes_them(harness, monkeypatch):
    """A delete frees room slice by slice: the instances still waiting for it to remove them are
    not placed (and started, and stopped) meanwhile."""
    from controller.deploy import changes as deployments

    ctl = await harness.start()
    await harness.register("node-a", accelerators=4)
    ctl.apply_deployment(small_deployment([{"name": "u", "role": "union", "count": 10}]))
    ctl.reconcile_once()
    st = ctl.state
    placed = {s.instance_id for s in st.slots.values() if s.node_id}
    assert len(placed) == 4  # the others wait PENDING
    monkeypatch.setattr(deployments, "Budget", lambda: Budget(seconds=0.0))  # a slice per item
    changes = ctl.changes
    plan = run_at_once(changes._plan(None))
    with changes._leaving(plan):
        changes.state.store.write_change(changes._store_change(plan))
    for _ in changes._change_memory(plan):  # room freed as placed instances go
        ctl.reconcile_once()
        assert {s.instance_id for s in st.slots.values() if s.node_id} <= placed
    assert not st.instances and not st.leaving


def test_expanding_a_deployment_yields_between_instances_and_gives_what_expanding_at_once_does():
    """A 10,000-instance deployment was expanded at once at the start of every apply (25-40 ms)."""
    from controller.rules.deployment_checks import validate_deployment
    from controller.rules.expansion import expand, expand_in_slices

    deployment = validate_deployment(
        small_deployment(
            [
                {"name": "p", "role": "prefill", "count": 3, "pair_with": "d"},
                {"name": "d", "role": "decode", "count": 3},
            ]
        )
    )
    steps, yields = expand_in_slices(deployment, Budget(seconds=0.0)), 0
    while True:
        try:
            next(steps)
            yields += 1
        except StopIteration as done:
            sliced = done.value
            break
    assert yields >= 6 and sliced == expand(deployment)
    assert sliced["p-1"].paired_instance_id == "d-1" and sliced["d-1"].paired_instance_id == "p-1"
