"""The controller on losing nodes and on its own restart, against a fake node-manager client (no gRPC,
no processes): stale heartbeats, lost nodes' engines moved and fenced, the silent-nodes alarm, the
reschedule rate limit, the start-up grace."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from motor.contract import heartbeats
from motor.errors import FailedPrecondition, NotFound
from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T
from tests.support import async_wait_for
from tests.support.controller_fakes import ManualClock
from tests.support.controller_harness import Harness, running_example, small_deployment

HELD_BY_ALARM = "not declared lost while the silent-nodes alarm is on"


async def test_stale_and_unknown_heartbeats_are_refused(harness):
    await harness.start()
    generation, _ = await harness.register("node-a")
    with pytest.raises(NotFound):
        harness.controller.heartbeat("node-x", 1, [])
    await harness.register("node-a")  # re-registration: a new generation
    with pytest.raises(FailedPrecondition, match="stale"):
        harness.controller.heartbeat("node-a", generation, [])


async def test_lost_node_engines_move_and_come_back_fenced(harness):
    await running_example(harness, nodes=("node-a", "node-b", "node-c"))
    client, ctl = harness.client, harness.controller
    victim = next(n for n, e in client.engines.items() if "decode-0/rank0" in e)
    others = [n for n in ("node-a", "node-b", "node-c") if n != victim]
    old = client.engines[victim]["decode-0/rank0"]
    client.unreachable.add(victim)

    async with harness.beating(*others):
        await async_wait_for(lambda: ctl.nodes[victim].state == C.NODE_STATE_LOST, timeout=5, what="node lost")
        assert ("list", victim) in client.calls  # re-checked directly before being declared lost
        kinds = [e.type for e in ctl.events.recent if e.node_id == victim]
        assert kinds.index(C.EVENT_TYPE_NODE_SUSPECT) < kinds.index(C.EVENT_TYPE_NODE_LOST)
        await async_wait_for(lambda: ctl.slots["decode-0/rank0"].node_id in others, timeout=5, what="engine moved")
        with pytest.raises(FailedPrecondition):
            harness.beat(victim)
        # The node comes back with its old copy still running: it is fenced.
        client.unreachable.discard(victim)
        _, assignments = await harness.register(victim)
        assert "decode-0/rank0" not in {a.engine_id for a in assignments}
        await async_wait_for(lambda: (victim, "decode-0/rank0", old.spec.generation) in client.stops(), timeout=5)
        assert any(e.type == C.EVENT_TYPE_ENGINE_FENCED for e in ctl.events.recent)


async def test_a_start_hanging_on_a_node_declared_lost_is_abandoned_and_its_rank_placed_again(harness):
    """A StartEngine in flight to a frozen node manager held its rank (busy) until the call ran
    out its timeout (15 s) after the node was declared LOST: the move waited for it."""
    await running_example(harness, nodes=("node-a", "node-b", "node-c"))
    client, ctl = harness.client, harness.controller
    victim = next(n for n, e in client.engines.items() if "decode-0/rank0" in e)
    others = [n for n in ("node-a", "node-b", "node-c") if n != victim]
    client.frozen.add(victim)
    client.engines[victim]["decode-0/rank0"].state = T.ENGINE_STATE_FAILED
    harness.beat(*others, victim)  # the failure: a restart on the same node, which hangs there
    await async_wait_for(lambda: len(client.starts("decode-0/rank0")) == 2, timeout=5, what="the restart's StartEngine")
    assert ctl.slots["decode-0/rank0"].busy
    client.unreachable.add(victim)  # its re-check fails too

    async with harness.beating(*others):
        await async_wait_for(lambda: ctl.nodes[victim].state == C.NODE_STATE_LOST, timeout=5, what="node lost")
        assert ("abandon", victim) in client.calls
        await async_wait_for(lambda: len(client.starts("decode-0/rank0")) == 3, timeout=5, what="a start elsewhere")
        calls = [c for c in client.calls if c[0] == "start" and c[2].instance_id == "decode-0"]
        assert calls[-1][1] in others and calls[-1][2].generation > calls[-2][2].generation
        assert not any(
            e.type == C.EVENT_TYPE_RETRYING for e in ctl.events.recent
        )  # not "trying again" on the lost node


async def test_many_silent_nodes_raise_an_alarm_and_nothing_moves(harness):
    await running_example(harness, nodes=("node-a", "node-b", "node-c"))
    client, ctl = harness.client, harness.controller
    client.unreachable.update({"node-a", "node-b"})

    async with harness.beating("node-c"):
        await async_wait_for(lambda: ctl.alarm, timeout=5, what="alarm")
        assert "2 of 3 nodes silent at once" in ctl.list_nodes()[1][0]
        # Both re-checks failed, and the alarm holds both back from being declared lost.
        await async_wait_for(
            lambda: all(HELD_BY_ALARM in ctl.nodes[n].reason for n in ("node-a", "node-b")),
            timeout=5,
            what="both nodes held back by the alarm",
        )
        assert all(ctl.nodes[n].state == C.NODE_STATE_SUSPECT for n in ("node-a", "node-b"))
        assert len(client.starts()) == 3 and not client.stops()
        client.unreachable.clear()
        await async_wait_for(lambda: not ctl.alarm, timeout=5, what="alarm cleared by re-checks")
        assert all(n.state == C.NODE_STATE_READY for n in ctl.nodes.values())


async def test_time_the_controller_did_not_run_is_not_counted_as_the_nodes_silence(harness, caplog):
    """A controller stopped (SIGSTOP) or its loop held for longer than the grace: on resuming, the
    node monitor ran before the heartbeats waiting in its sockets were read, and every node turned
    SUSPECT at once, the silent-nodes alarm with them (found by a hostile tester)."""
    await running_example(harness, nodes=("node-a", "node-b", "node-c"))
    ctl = harness.controller
    harness.beat("node-a", "node-b", "node-c")
    time.sleep(3 * harness.config.node_grace)  # the loop held, as a stopped process's would be
    await asyncio.sleep(0.3)  # the monitor runs (no heartbeat read yet)
    assert all(n.state == C.NODE_STATE_READY for n in ctl.nodes.values()), {
        n.node_id: n.reason for n in ctl.nodes.values()
    }
    assert not ctl.alarm and not [e for e in ctl.events.recent if e.type == C.EVENT_TYPE_NODE_SUSPECT]
    assert "the controller did not run for" in caplog.text
    # Silence while the controller runs still counts.
    harness.client.unreachable.add("node-c")
    await async_wait_for(lambda: ctl.nodes["node-c"].state != C.NODE_STATE_READY, timeout=10, what="node-c suspect")


async def test_nodes_silent_together_but_noticed_one_by_one_raise_the_alarm(tmp_path):
    clock = ManualClock()
    h = Harness(tmp_path, clock=clock)  # heartbeat 0.1 s, grace 0.6 s
    try:
        await running_example(h, nodes=("node-a", "node-b", "node-c"))
        ctl, client = h.controller, h.client
        starts = len(client.starts())
        client.unreachable.update({"node-a", "node-b"})
        # Both stop at once; node-b's last heartbeat came one interval after node-a's.
        clock.advance(0.1)
        h.beat("node-b", "node-c")
        clock.advance(0.55)
        h.beat("node-c")
        ctl.check_nodes()
        assert (ctl.nodes["node-a"].state, ctl.nodes["node-b"].state) == (C.NODE_STATE_SUSPECT, C.NODE_STATE_READY)
        await async_wait_for(
            lambda: ctl.nodes["node-a"].recheck_failed_at is not None, timeout=5, what="node-a re-check failed"
        )
        ctl.check_nodes()
        assert ctl.nodes["node-a"].state == C.NODE_STATE_SUSPECT  # not lost before node-b had time to turn SUSPECT
        clock.advance(0.1)
        h.beat("node-c")
        ctl.check_nodes()
        assert ctl.nodes["node-b"].state == C.NODE_STATE_SUSPECT and "2 of 3 nodes silent at once" in ctl.alarm
        await async_wait_for(
            lambda: ctl.nodes["node-b"].recheck_failed_at is not None, timeout=5, what="node-b re-check failed"
        )
        clock.advance(0.5)
        h.beat("node-c")
        ctl.check_nodes()
        assert all(HELD_BY_ALARM in ctl.nodes[n].reason for n in ("node-a", "node-b"))
        assert all(ctl.nodes[n].state == C.NODE_STATE_SUSPECT for n in ("node-a", "node-b"))
        assert len(client.starts()) == starts and not client.stops()
    finally:
        await h.stop()


async def test_moves_off_lost_nodes_wait_for_the_reschedule_rate_limit(tmp_path):
    clock = ManualClock()
    h = Harness(tmp_path, clock=clock, reschedule_rate=0.01)  # a burst of 1 move, then 1 per 100 s
    try:
        ctl = await h.start()
        for node in ("node-a", "node-b", "node-c", "node-d"):
            await h.register(node, accelerators=1)
        ctl.apply_deployment(small_deployment([{"name": "u", "role": "union", "count": 2}]))
        await async_wait_for(lambda: len(h.client.starts()) == 2, timeout=5, what="2 engines started")
        victims = {ctl.slots["u-0/rank0"].node_id, ctl.slots["u-1/rank0"].node_id}
        spare = sorted({"node-a", "node-b", "node-c", "node-d"} - victims)
        assert len(victims) == 2
        h.client.unreachable.update(victims)
        clock.advance(h.config.node_grace + 0.1)
        h.beat(*spare)
        ctl.check_nodes()  # 2 of 4 silent: no alarm; re-checked, refused
        await async_wait_for(lambda: all(ctl.nodes[n].recheck_failed_at is not None for n in victims), timeout=5)
        clock.advance(2 * h.config.heartbeat_interval)
        h.beat(*spare)
        ctl.check_nodes()
        assert all(ctl.nodes[n].state == C.NODE_STATE_LOST for n in victims)
        await async_wait_for(lambda: len(h.client.starts()) >= 3, timeout=5, what="the first move")
        ctl.reconcile_once()
        waiting = [i for i in ("u-0", "u-1") if not ctl.slots[f"{i}/rank0"].node_id]
        assert len(waiting) == 1, "the second move should wait for the rate limit"
        assert len(h.client.starts()) == 3
        inst = h.instance(waiting[0])
        assert inst.state == C.INSTANCE_STATE_PENDING
        assert inst.reason == "waiting for the reschedule rate limit (0.01 engines/s)"
        clock.advance(100)  # the bucket holds one move again
        h.beat(*spare)
        ctl.reconcile_once()
        await async_wait_for(lambda: len(h.client.starts()) == 4, timeout=5, what="the second move")
        assert {s.node_id for s in ctl.slots.values()} == set(spare)
    finally:
        await h.stop()


async def test_after_a_restart_nothing_starts_until_every_node_reported_or_the_grace_ended(tmp_path):
    clock = ManualClock()
    h = Harness(tmp_path, clock=clock, node_grace=5.0, startup_grace=1.0)
    try:
        await running_example(h, accelerators=2)  # 3 ranks on 2 accelerators per node: both nodes used
        client = h.client
        on_b = sorted(client.engines["node-b"])
        before = len(client.starts())
        assert on_b and before == 3
        await h.stop()
        ctl = await h.start(client)
        h.beat("node-a")  # node-b has not reported to this process yet
        ctl.reconcile_once()
        await asyncio.sleep(0)  # a launch would have called StartEngine by now
        assert len(client.starts()) == before
        clock.advance(1.5)  # the start-up grace ends without node-b
        h.beat("node-a")
        ctl.reconcile_once()
        await async_wait_for(lambda: len(client.starts()) == before + len(on_b), timeout=5)
        started = [c for c in client.calls if c[0] == "start"][before:]
        assert sorted(f"{c[2].instance_id}/rank{c[2].dp_rank}" for c in started) == on_b
        assert {c[1] for c in started} == {"node-b"}
    finally:
        await h.stop()


@contextlib.asynccontextmanager
async def restarted(path, **settings):
    """The running example on a hand-driven clock (grace 5 s, interval 1 s), then its controller
    restarted on the same store: (harness, the new controller, the clock)."""
    clock = ManualClock()
    h = Harness(path, clock=clock, node_grace=5.0, heartbeat_interval=1.0, **settings)
    try:
        await running_example(h)
        client = h.client
        await h.stop()
        yield h, await h.start(client), clock
    finally:
        await h.stop()


async def test_after_a_restart_a_node_has_the_grace_and_a_node_managers_longest_backoff_to_report(tmp_path):
    """A node manager backs off (up to MAX_BACKOFF) while the controller is away: its first report
    may come that long after the controller is back. Judged by the grace alone, every node was
    SUSPECT after a 25 s outage (found by a hostile tester)."""
    async with restarted(tmp_path) as (h, ctl, clock):
        clock.advance(5.0 + heartbeats.MAX_BACKOFF - 0.5)
        ctl.check_nodes()
        assert all(n.state == C.NODE_STATE_READY for n in ctl.nodes.values())
        h.beat("node-a")
        clock.advance(1.0)
        ctl.check_nodes()
        node_b = ctl.nodes["node-b"]
        assert ctl.nodes["node-a"].state == C.NODE_STATE_READY and node_b.state == C.NODE_STATE_SUSPECT
        assert node_b.reason.startswith(
            f"no heartbeat since this controller started ({5.0 + heartbeats.MAX_BACKOFF + 0.5:.1f}s ago"
        )


async def test_after_a_restart_a_node_that_reported_then_fell_silent_is_suspected_on_its_own_grace(tmp_path):
    """The nodes still waiting to report held it back: they were loaded as heard from in the
    future, so the silent-node sweep, oldest first, stopped at them (found by a hostile tester:
    SUSPECT 12.7 s after the kill, and the alarm with the waiting nodes)."""
    async with restarted(tmp_path) as (h, ctl, clock):
        clock.advance(1.0)
        h.beat("node-a")  # node-a reports, then dies; node-b has not reported yet
        clock.advance(5.1)
        ctl.check_nodes()
        assert ctl.nodes["node-a"].state == C.NODE_STATE_SUSPECT and ctl.nodes["node-b"].state == C.NODE_STATE_READY
        assert ctl.nodes["node-a"].reason.startswith("no heartbeat for 5.1s")


async def test_after_a_restart_the_default_startup_grace_waits_out_a_node_managers_backoff_too(tmp_path):
    """StartEngine went to nodes that had not reported yet, 5 s after a 45 s outage (found by a
    hostile tester); an explicit --startup-grace is kept as given."""
    for given, expected in ((None, 5.0 + heartbeats.MAX_BACKOFF), (2.0, 2.0)):
        async with restarted(tmp_path / str(given), startup_grace=given) as (_, ctl, clock):
            assert ctl.lifecycle.startup_until - clock() == pytest.approx(expected)
