"""The controller's behaviour against a fake node-manager client (no gRPC, no processes)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from controller.engines.node_client import GrpcNodeClient, NodeCallError
from controller.model.events import EVENT_MESSAGE_CHARS
from motor.contract import start_refusals
from motor.contract.names import CONTROL_CHARACTER
from motor.errors import InvalidArgument, NotFound
from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T
from tests.support import async_wait_for
from tests.support.controller_harness import Harness, example_deployment, node_info, running_example, small_deployment


async def test_apply_places_every_rank_with_master_ip_config_and_generation(harness):
    await running_example(harness)
    starts = {f"{s.instance_id}/rank{s.dp_rank}": s for s in harness.client.starts()}
    assert set(starts) == {"prefill-0/rank0", "prefill-0/rank1", "decode-0/rank0"}
    rank0_node = next(
        c[1] for c in harness.client.calls if c[0] == "start" and c[2].instance_id == "prefill-0" and c[2].dp_rank == 0
    )
    expected_host = {"node-a": "10.0.0.1", "node-b": "10.0.0.2"}[rank0_node]
    assert starts["prefill-0/rank0"].master_dp_ip == starts["prefill-0/rank1"].master_dp_ip == expected_host
    config = json.loads(starts["decode-0/rank0"].config_json)
    assert config["motor_engine_decode_config"]["engine_type"] == "sim"
    generations = [s.generation for s in starts.values()]
    assert all(generations) and len(set(generations)) == 3
    # Distinct accelerators per node.
    used = [(c[1], a) for c in harness.client.calls if c[0] == "start" for a in c[2].accelerator_ids]
    assert len(used) == len(set(used)) == 3
    listed = {i.instance_id: i for i in harness.controller.list_instances()}
    assert listed["prefill-0"].paired_instance_id == "decode-0"
    assert listed["decode-0"].paired_instance_id == "prefill-0"
    endpoints = harness.controller.list_endpoints(T.ROLE_PREFILL)
    assert [e.engine_id for e in endpoints] == ["prefill-0/rank0", "prefill-0/rank1"]
    assert all(e.url.startswith("http://10.0.0.") for e in endpoints)


async def test_apply_is_idempotent_and_stored_before_return(harness):
    await harness.start()
    _, first = harness.controller.apply_deployment(example_deployment())
    _, again = harness.controller.apply_deployment(example_deployment())
    assert first == again == 1
    stored = harness.store.load()
    assert stored.revision == 1 and C.Deployment.FromString(stored.deployment).name == "local-sim"
    changed = example_deployment()
    changed.restart_policy.max_failures = 9
    _, third = harness.controller.apply_deployment(changed)
    assert third == 2


async def test_invalid_deployment_names_the_field_and_changes_nothing(harness):
    await harness.start()
    harness.controller.apply_deployment(example_deployment())
    bad = small_deployment(
        [
            {"name": "Bad Name", "role": "prefill"},
            {"name": "d", "role": "decode", "count": 2},
            {"name": "p", "role": "prefill", "pair_with": "nope"},
        ]
    )
    with pytest.raises(InvalidArgument) as err:
        harness.controller.apply_deployment(bad)
    text = str(err.value)
    assert "instance_groups[0].name" in text and "instance_groups[2].pair_with" in text and "'nope'" in text
    assert harness.controller.revision == 1 and set(harness.controller.instances) == {"prefill-0", "decode-0"}


async def test_unplaceable_instance_is_pending_with_the_reason(harness):
    await harness.start()
    await harness.register("node-a", accelerators=1)
    harness.controller.apply_deployment(
        small_deployment([{"name": "big", "role": "union", "accelerators_per_engine": 2}])
    )
    await async_wait_for(lambda: "none has room" in harness.instance("big-0").reason, timeout=5)
    assert harness.instance("big-0").state == C.INSTANCE_STATE_PENDING
    assert "most free: node-a with 1/1 accelerators" in harness.instance("big-0").reason
    await harness.register("node-b", accelerators=2)  # room appears: placed without being asked again
    await async_wait_for(lambda: harness.client.starts("big-0/rank0"), timeout=5)
    assert harness.client.calls[-1][1] == "node-b"


async def test_failed_engine_restarts_at_once_then_backs_off_then_fails(harness):
    await running_example(harness, initial_backoff=0.3, max_backoff=10, max_failures=3)
    ctl, client = harness.controller, harness.client
    engine = client.engines[next(n for n, e in client.engines.items() if "decode-0/rank0" in e)]["decode-0/rank0"]
    node_id = engine.node_id

    def fail_decode(reason):
        current = client.engines[node_id]["decode-0/rank0"]
        current.state = T.ENGINE_STATE_FAILED
        ctl.report_engine_event(node_id, harness.generations[node_id], current, reason)

    fail_decode("killed after 5 abnormal heartbeats: probe timed out x5")
    inst = harness.instance("decode-0")
    assert inst.state == C.INSTANCE_STATE_RESTARTING and "restarting its data-parallel group now" in inst.reason
    # The same failed copy reported again before its restart ran (a heartbeat showing it with
    # another health) is not a second failure.
    again = T.Engine()
    again.CopyFrom(client.engines[node_id]["decode-0/rank0"])
    again.health = T.HEALTH_STATUS_ABNORMAL
    ctl.report_engine_event(node_id, harness.generations[node_id], again, "same-copy-again")
    assert len(inst.failure_times) == 1 and "restarting its data-parallel group now" in inst.reason
    assert not [e for e in ctl.events.recent if "same-copy-again" in e.message]
    await async_wait_for(lambda: len(client.starts("decode-0/rank0")) == 2, timeout=2, what="immediate restart")
    second = client.starts("decode-0/rank0")[-1]
    assert second.generation > engine.spec.generation
    messages = [e.message for e in ctl.events.recent]
    assert f"engine decode-0/rank0 on {node_id} killed after 5 abnormal heartbeats: probe timed out x5" in messages
    # A late report of the old generation's failure is ignored.
    ctl.report_engine_event(node_id, harness.generations[node_id], engine, "repeated-report")
    assert len([m for m in (e.message for e in ctl.events.recent) if "repeated-report" in m]) == 0

    fail_decode("exited with code 1")
    assert "in 0.3s" in inst.reason
    assert len(client.starts("decode-0/rank0")) == 2  # backing off, not restarted yet
    await async_wait_for(lambda: len(client.starts("decode-0/rank0")) == 3, timeout=5, what="restart after backoff")
    fail_decode("exited with code 1")
    assert inst.state == C.INSTANCE_STATE_FAILED and "crash-loop budget spent: 3 failures" in inst.reason
    await asyncio.sleep(0.8)
    assert len(client.starts("decode-0/rank0")) == 3  # left alone
    # Applying again gives it another chance.
    ctl.apply_deployment(example_deployment(initial_backoff=0.3, max_backoff=10, max_failures=3))
    await async_wait_for(lambda: len(client.starts("decode-0/rank0")) == 4, timeout=5)


async def test_a_failure_reported_without_words_is_described_from_the_exit(harness):
    await running_example(harness)
    client, ctl = harness.client, harness.controller
    node_id = next(n for n, e in client.engines.items() if "decode-0/rank0" in e)
    dead = client.engines[node_id]["decode-0/rank0"]
    dead.state, dead.exit_signal = T.ENGINE_STATE_FAILED, 9
    harness.beat(node_id)  # a heartbeat shows the copy FAILED, with no reason
    assert ctl.slots["decode-0/rank0"].last_failure_reason == "killed by signal 9 (SIGKILL)"


async def test_group_scope_restarts_every_rank_and_rank_scope_one(harness):
    await running_example(harness)
    client, ctl = harness.client, harness.controller
    node_id, engines = next((n, e) for n, e in client.engines.items() if "prefill-0/rank1" in e)
    failed = engines["prefill-0/rank1"]
    failed.state = T.ENGINE_STATE_FAILED
    ctl.report_engine_event(node_id, harness.generations[node_id], failed, "exited (signal 9)")
    await async_wait_for(
        lambda: len(client.starts("prefill-0/rank0")) == 2 and len(client.starts("prefill-0/rank1")) == 2, timeout=5
    )
    # The surviving rank 0 was stopped (fenced by its old generation) before its new copy started.
    assert any(s[1] == "prefill-0/rank0" for s in client.stops())


async def test_rank_scope_restarts_the_failed_rank_alone(harness):
    await running_example(harness, scope=C.RESTART_SCOPE_RANK)
    client, ctl = harness.client, harness.controller
    node_id, engines = next((n, e) for n, e in client.engines.items() if "prefill-0/rank1" in e)
    engines["prefill-0/rank1"].state = T.ENGINE_STATE_FAILED
    ctl.report_engine_event(node_id, harness.generations[node_id], engines["prefill-0/rank1"], "exited (signal 9)")
    await async_wait_for(lambda: len(client.starts("prefill-0/rank1")) == 2, timeout=5)
    await asyncio.sleep(0.3)
    assert len(client.starts("prefill-0/rank0")) == 1 and not client.stops()


async def test_restart_adopts_running_engines_without_restarting_them(harness):
    await running_example(harness)
    before = len(harness.client.starts())
    client = harness.client
    await harness.stop()
    ctl = await harness.start(client)
    assert ctl.revision == 1 and set(ctl.instances) == {"prefill-0", "decode-0"}
    assert ctl.nodes["node-a"].reason == "known from the store; waiting for it to report"
    harness.beat("node-a", "node-b")  # same generations as before the restart
    # The reason says what is true now (it stayed "waiting for it to report"; found by a hostile tester).
    assert ctl.nodes["node-a"].reason.startswith("reporting again since the controller started (generation ")
    await async_wait_for(lambda: all(i.state == C.INSTANCE_STATE_READY for i in ctl.instances.values()), timeout=5)
    await asyncio.sleep(1.2)  # past the start-up grace
    assert len(client.starts()) == before and not client.stops()


async def test_start_failure_counts_as_a_failure_with_the_reason(harness):
    await harness.start()
    await harness.register("node-a")
    harness.client.start_errors["solo-0/rank0"] = NodeCallError("FAILED_PRECONDITION", "port 21000 is in use")
    harness.controller.apply_deployment(small_deployment([{"name": "solo", "role": "union"}]))
    await async_wait_for(lambda: len(harness.client.starts("solo-0/rank0")) == 2, timeout=5)
    slot = harness.controller.slots["solo-0/rank0"]
    assert "port 21000 is in use" in slot.last_failure_reason and slot.restarts == 1


async def test_a_start_refused_for_accelerators_still_held_is_a_wait_not_a_failure(harness):
    """Hostile F7: an old copy still stopping holds the accelerators; the start is tried again
    after a backoff, with one RETRYING event whose count grows, and the crash-loop budget is untouched."""
    await harness.start()
    await harness.register("node-a")
    held = start_refusals.accelerators_held([0], ["a-0/rank0"])
    harness.client.start_errors["solo-0/rank0"] = NodeCallError(held.code.name, str(held))
    harness.controller.apply_deployment(
        small_deployment([{"name": "solo", "role": "union"}], restart_policy={"max_failures": 1})
    )
    await async_wait_for(lambda: len(harness.client.starts("solo-0/rank0")) == 1, timeout=10)
    harness.client.start_errors["solo-0/rank0"] = NodeCallError(held.code.name, str(held))  # still held at the next try
    await async_wait_for(
        lambda: len(harness.client.starts("solo-0/rank0")) == 3, timeout=10, what="tried again, then started"
    )
    slot, inst = harness.controller.slots["solo-0/rank0"], harness.instance("solo-0")
    assert slot.restarts == 0 and not slot.last_failure_reason and inst.state != C.INSTANCE_STATE_FAILED
    waits = [e for e in harness.controller.events.recent if e.type == C.EVENT_TYPE_RETRYING]
    assert len(waits) == 1 and waits[0].count == 2 and "in use by ['a-0/rank0']" in waits[0].message
    assert not [e for e in harness.controller.events.recent if e.type == C.EVENT_TYPE_ENGINE_FAILED]
    assert slot.launched


async def test_accelerators_an_old_copy_still_holds_are_not_offered_while_another_node_has_room(harness):
    """Hostile F7: a replaced deployment's engine on node-a is still stopping (node-a still
    reports it RUNNING); the new engine goes to node-b, which has room, rather than waiting on
    node-a. Once node-a no longer reports the old copy, its accelerator is offered again."""
    await harness.start()
    await harness.register("node-a", accelerators=1)
    await harness.register("node-b", accelerators=1)
    ctl = harness.controller
    ctl.apply_deployment(small_deployment([{"name": "old", "role": "union"}]))
    await async_wait_for(lambda: harness.client.starts("old-0/rank0"), timeout=5)
    assert ctl.slots["old-0/rank0"].node_id == "node-a"  # the tie goes to the first node id
    harness.client.set_health("node-a")
    # Copies, as a real node's report is: the fake's records change when it is asked to stop.
    still_running = [T.Engine.FromString(e.SerializeToString()) for e in harness.client.report("node-a")]
    ctl.heartbeat("node-a", harness.generations["node-a"], still_running)
    ctl.apply_deployment(small_deployment([{"name": "new", "role": "union"}]))
    await async_wait_for(lambda: harness.client.starts("new-0/rank0"), timeout=5)
    assert ctl.slots["new-0/rank0"].node_id == "node-b"
    # A third engine: only node-a's accelerator is left, held by the old copy it still reports.
    ctl.apply_deployment(small_deployment([{"name": "new", "role": "union", "count": 2}]))
    await asyncio.sleep(0.3)
    assert not ctl.slots["new-1/rank0"].node_id and not harness.client.starts("new-1/rank0")
    harness.beat("node-a")  # the old copy is stopped now (the fake stopped it when asked)
    await async_wait_for(
        lambda: harness.client.starts("new-1/rank0"), timeout=5, what="placed once the old copy is gone"
    )
    assert ctl.slots["new-1/rank0"].node_id == "node-a"


async def test_a_node_whose_address_answers_as_another_node_is_set_aside_and_the_rank_placed_elsewhere(harness):
    """Hostile F9: node-c registered at node-a's address; node-a's node manager refuses the start
    for node-c. The rank goes to a healthy node without spending its crash-loop budget, node-c
    gets no engines until it registers again, and an event names --advertise-address."""
    await harness.start()
    await harness.register("node-a", accelerators=4)
    await harness.register("node-c", accelerators=1)  # the best fit: the node with the fewest free accelerators
    wrong = start_refusals.wrong_node("node-c", "node-a")
    harness.client.start_errors["solo-0/rank0"] = NodeCallError(wrong.code.name, str(wrong))
    ctl = harness.controller
    ctl.apply_deployment(small_deployment([{"name": "solo", "role": "union"}], restart_policy={"max_failures": 1}))

    def started_on(engine: str) -> list[str]:
        return [
            c[1] for c in harness.client.calls if c[0] == "start" and f"{c[2].instance_id}/rank{c[2].dp_rank}" == engine
        ]

    await async_wait_for(
        lambda: started_on("solo-0/rank0") == ["node-c", "node-a"],
        timeout=10,
        what="refused on node-c, then started on node-a",
    )
    slot = ctl.slots["solo-0/rank0"]
    assert slot.node_id == "node-a" and slot.restarts == 0 and not slot.last_failure_reason
    assert harness.instance("solo-0").state != C.INSTANCE_STATE_FAILED
    node_c = next(n for n in ctl.list_nodes()[0] if n.info.node_id == "node-c")
    assert node_c.state == C.NODE_STATE_READY and "answers as another node" in node_c.state_reason
    assert "--advertise-address" in node_c.state_reason
    told = [e for e in ctl.events.recent if e.type == C.EVENT_TYPE_NODE_CONFLICT and e.node_id == "node-c"]
    assert len(told) == 1 and "--advertise-address" in told[0].message and "node-a's node manager" in told[0].message
    assert not [e for e in ctl.events.recent if e.type == C.EVENT_TYPE_ENGINE_FAILED]
    # No new engine is placed on node-c while it is set aside, even with room there only.
    await harness.register("node-a", accelerators=1)
    ctl.apply_deployment(small_deployment([{"name": "solo", "role": "union"}, {"name": "more", "role": "union"}]))
    await asyncio.sleep(0.3)
    assert not ctl.slots["more-0/rank0"].node_id and not harness.client.starts("more-0/rank0")
    # Registering again (with its own address, an operator's fix) makes it usable again.
    await harness.register("node-c", accelerators=1)
    await async_wait_for(lambda: started_on("more-0/rank0") == ["node-c"], timeout=10)


async def test_delete_stops_engines(harness):
    await running_example(harness)
    harness.controller.delete_deployment()
    await async_wait_for(lambda: len(harness.client.stops()) == 3, timeout=5)
    with pytest.raises(NotFound):
        harness.controller.get_deployment()
    assert harness.controller.list_instances() == []


async def test_a_health_or_state_number_this_version_does_not_know_is_shown_by_number_not_a_crash(harness):
    # A newer node manager (or a hostile one) may report enum numbers this controller has no name for.
    await running_example(harness)
    engines = harness.client.engines["node-a"].values()
    for engine in engines:
        engine.health, engine.health_reason = 77, "a health of a newer version"
    harness.beat("node-a")  # answered (it raised ValueError: HealthStatus has no name for 77)
    degraded = [i for i in harness.controller.instances.values() if i.state == C.INSTANCE_STATE_DEGRADED]
    assert degraded and all("RUNNING/UNKNOWN_77 (a health of a newer version)" in i.reason for i in degraded)
    for engine in engines:
        engine.state = 99
    harness.beat("node-a")
    assert any("UNKNOWN_99/UNKNOWN_77" in i.reason for i in harness.controller.instances.values())


async def test_reported_free_text_reaches_events_and_logs_on_one_bounded_line(harness, caplog):
    # state_reason and health_reason are free text (an engine's own words may hold a traceback):
    # not refused, but a newline must not forge a log line, nor a megabyte stay in the history.
    await running_example(harness)
    forged = "exited\n2026-11-23 06:00:00,000 ERROR controller: forged line\x00" + "x" * 1_000_000
    engine = next(iter(harness.client.engines["node-a"].values()))
    engine.state, engine.state_reason = T.ENGINE_STATE_FAILED, forged
    with caplog.at_level("INFO", logger="controller.model.events"):
        harness.beat("node-a")
    [failed] = [e for e in harness.controller.events.recent if e.type == C.EVENT_TYPE_ENGINE_FAILED]
    assert failed.message.startswith(f"engine {engine.engine_id} on node-a exited\\n2026-11-23"), failed.message[:200]
    assert not CONTROL_CHARACTER.search(failed.message) and len(failed.message) <= EVENT_MESSAGE_CHARS + 40
    assert failed.message.endswith(" characters)")
    assert not any(CONTROL_CHARACTER.search(r.getMessage()) for r in caplog.records)


async def test_a_node_back_on_a_new_address_lets_go_of_the_old_addresss_channel(harness):
    """A node manager that comes back on another address (a rescheduled pod): the controller lets
    go of what it kept for the old one, unless another node is reached there."""
    await harness.start()
    await harness.register("node-a")
    old = harness.controller.state.nodes["node-a"].info.address
    await harness.register("node-a")  # same address: nothing to let go of
    moved = node_info("node-a")
    moved.address = "127.0.0.1:2999"
    await harness.controller.register_node(moved, [])
    await async_wait_for(lambda: ("forget", old) in harness.client.calls, timeout=5, what="the old address forgotten")
    assert [c for c in harness.client.calls if c[0] == "forget"] == [("forget", old)]

    shared = node_info("node-b")
    shared.address = "127.0.0.1:2999"  # node-b reached where node-a is now
    await harness.controller.register_node(shared, [])
    elsewhere = node_info("node-a")
    elsewhere.address = "127.0.0.1:2998"
    await harness.controller.register_node(elsewhere, [])
    await asyncio.sleep(0.1)
    assert [c for c in harness.client.calls if c[0] == "forget"] == [("forget", old)], "node-b is still reached there"


async def test_the_grpc_client_closes_a_forgotten_addresss_channel():
    client = GrpcNodeClient()
    node = node_info("node-a")
    client._stub(node)
    channel = client.channels[node.address]
    await client.forget(node.address)
    assert node.address not in client.channels
    with pytest.raises(grpc.aio.UsageError):  # closed: no call can start on it
        await channel.channel.channel_ready()
    await client.forget("127.0.0.1:1")  # never called: nothing to do
    await client.close()


async def test_launches_in_flight_are_capped_and_the_rest_follow_as_they_finish(tmp_path, monkeypatch):
    """A pass spawned a launch task for every placed engine at once: 40,000 waiting tasks for a
    10,000 x dp 4 deployment, a transient heap that set off a complete garbage walk (0.14-0.34 s)."""
    from controller.capacity import scheduling
    from tests.support.controller_fakes import FakeNodeClient

    class Gated(FakeNodeClient):
        def __init__(self):
            super().__init__()
            self.gate, self.open, self.most = asyncio.Event(), 0, 0

        async def start_engine(self, node, spec):
            self.open += 1
            self.most = max(self.most, self.open)
            try:
                await self.gate.wait()
                return await super().start_engine(node, spec)
            finally:
                self.open -= 1

    monkeypatch.setattr(scheduling, "LAUNCHES_OPEN", 2)
    h = Harness(tmp_path)
    client = Gated()
    await h.start(client)
    try:
        await h.register("node-a", accelerators=8)
        h.controller.apply_deployment(example_deployment())  # 3 engines
        await async_wait_for(lambda: client.open == 2, timeout=5, what="two launches in flight")
        await asyncio.sleep(1.2)  # passes run meanwhile (every 0.5 s)
        assert client.most == 2 and h.controller.scheduler.launches_open == 2
        client.gate.set()
        await async_wait_for(lambda: len(client.starts()) == 3, timeout=5, what="the third launch once room was made")
        await async_wait_for(lambda: h.controller.scheduler.launches_open == 0, timeout=5)
    finally:
        await h.stop()
