"""Several named deployments on one controller: each created, changed and deleted alone, with its
own revision, restart policy and events; group names (hence instance ids) unique across them;
the deployment of a store written before names loaded under its name with nothing restarted."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from controller.store.interface import LEGACY_DEPLOYMENT
from controller.store.sqlite import SqliteStore
from motor.errors import InvalidArgument, NotFound
from motor.v1 import controller_pb2 as C
from tests.support import async_wait_for
from tests.support.controller_harness import small_deployment


def chat(**extra):
    return small_deployment([{"name": "chat", "role": "union", "count": 2}], name="chat", model="sim-chat", **extra)


def embed(**extra):
    return small_deployment([{"name": "embed", "role": "union", "count": 1}], name="embed", model="sim-embed", **extra)


async def two_running(harness):
    ctl = await harness.start()
    await harness.register("node-a", accelerators=4)
    ctl.apply_deployment(chat())
    ctl.apply_deployment(embed())
    ctl.reconcile_once()
    await async_wait_for(lambda: len(harness.client.starts()) == 3, timeout=5, what="the three engines started")
    return ctl


async def test_two_deployments_run_side_by_side_and_deleting_one_leaves_the_other_alone(harness):
    ctl = await two_running(harness)
    assert set(ctl.instances) == {"chat-0", "chat-1", "embed-0"}
    assert ctl.get_deployment("chat")[1] == 1 and ctl.get_deployment("embed")[1] == 1
    listed = {d.deployment.name: d for d in ctl.list_deployments().deployments}
    assert list(listed) == ["chat", "embed"] and listed["chat"].instances == 2 and listed["embed"].instances == 1
    assert {i.instance_id: i.deployment for i in ctl.list_instances()} == {
        "chat-0": "chat",
        "chat-1": "chat",
        "embed-0": "embed",
    }
    only_chat = ctl.page_instances(C.ListInstancesRequest(filter="deployment=chat"))
    assert [i.instance_id for i in only_chat.instances] == ["chat-0", "chat-1"]

    ctl.apply_deployment(chat(restart_policy={"max_failures": 2}))  # chat changes: embed is not touched
    assert ctl.get_deployment("chat")[1] == 2 and ctl.get_deployment("embed")[1] == 1
    assert len(harness.client.starts("embed-0/rank0")) == 1 and not harness.client.stops()

    ctl.delete_deployment("chat")
    assert set(ctl.instances) == {"embed-0"} and ctl.get_deployment()[0].name == "embed"
    await async_wait_for(lambda: len(harness.client.stops()) == 2, timeout=5, what="chat's engines stopped")
    stopped = {engine_id for _, engine_id, _ in harness.client.stops()}
    assert stopped == {"chat-0/rank0", "chat-1/rank0"}  # nothing of embed's
    with pytest.raises(NotFound, match="name: no deployment is named 'chat'"):
        ctl.get_deployment("chat")
    events = [e for e in ctl.events.recent if e.type == C.EVENT_TYPE_DEPLOYMENT_CHANGED]
    assert [e.deployment for e in events[-4:]] == ["chat", "embed", "chat", "chat"]
    stored = harness.store.load()
    assert set(stored.deployments) == {"embed"} and set(stored.instances) == {"embed-0"}


async def test_each_deployment_keeps_its_own_restart_policy(harness):
    ctl = await harness.start()
    await harness.register("node-a", accelerators=4)
    ctl.apply_deployment(chat(restart_policy={"max_failures": 1}))
    ctl.apply_deployment(embed(restart_policy={"max_failures": 5}))
    ctl.reconcile_once()
    await async_wait_for(lambda: len(harness.client.starts()) == 3, timeout=5, what="the three engines started")
    for engine_id in ("chat-0/rank0", "embed-0/rank0"):
        slot = ctl.slots[engine_id]
        ctl.lifecycle.engine_failed(slot, slot.node_id, "exited with code 1")
    assert harness.instance("chat-0").state == C.INSTANCE_STATE_FAILED  # its budget: one failure
    assert harness.instance("embed-0").state == C.INSTANCE_STATE_RESTARTING  # its own: five
    failed = [
        e for e in ctl.events.recent if e.type == C.EVENT_TYPE_INSTANCE_STATE_CHANGED and e.instance_id == "chat-0"
    ]
    assert failed[-1].deployment == "chat"


async def test_bad_requests_name_the_field_and_change_nothing(harness):
    ctl = await two_running(harness)
    before = (set(ctl.instances), ctl.get_deployment("chat"), ctl.get_deployment("embed"))
    thief = small_deployment([{"name": "u", "role": "union"}, {"name": "chat", "role": "union"}], name="thief")
    with pytest.raises(InvalidArgument, match=r"instance_groups\[1\]\.name: 'chat' is a group of deployment 'chat'"):
        ctl.apply_deployment(thief)
    with pytest.raises(InvalidArgument, match=r"name: 'Big Model!' must be 1-63 lowercase"):
        ctl.apply_deployment(small_deployment([{"name": "x", "role": "union"}], name="Big Model!"))
    with pytest.raises(NotFound, match="name: no deployment is named 'nope' \\(deployments: chat, embed\\)"):
        ctl.delete_deployment("nope")
    with pytest.raises(InvalidArgument, match="name: required: 2 deployments exist \\(chat, embed\\)"):
        ctl.delete_deployment()
    with pytest.raises(InvalidArgument, match="name: required: 2 deployments exist"):
        ctl.get_deployment()
    assert (set(ctl.instances), ctl.get_deployment("chat"), ctl.get_deployment("embed")) == before
    assert not harness.client.stops() and "thief" not in harness.store.load().deployments


async def test_a_store_of_before_names_is_loaded_under_its_name_and_nothing_restarts(harness, tmp_path):
    ctl = await harness.start()
    await harness.register("node-a", accelerators=4)
    ctl.apply_deployment(chat())
    ctl.reconcile_once()
    await async_wait_for(lambda: len(harness.client.starts()) == 2, timeout=5, what="chat's engines started")
    starts = len(harness.client.starts())
    await harness.stop()
    # Rewrite the store as a controller of before names left it: the deployment in the meta rows.
    store = SqliteStore(harness.db)
    data, revision = store.load().deployments["chat"]
    with store.transaction():
        store.save_deployment(None, 0, "chat")
        store.db.execute("DELETE FROM meta WHERE key = 'applied'")
        store.save_deployment(data, revision)
    assert set(store.load().deployments) == {LEGACY_DEPLOYMENT}
    store.close()

    ctl = await harness.start(harness.client)
    assert ctl.get_deployment("chat") == (C.Deployment.FromString(data), revision)
    assert set(ctl.instances) == {"chat-0", "chat-1"} and not ctl.adoption.waiting
    await harness.register("node-a", accelerators=4)
    ctl.reconcile_once()
    await asyncio.sleep(0.3)  # launches, had any been wanted, would have been made by now
    assert len(harness.client.starts()) == starts and not harness.client.stops()  # same engines, none restarted
    stored = harness.store.load()
    assert set(stored.deployments) == {"chat"} and stored.deployments["chat"][1] == revision


async def test_a_deployment_that_does_not_fit_waits_and_room_goes_first_come_first_served(harness):
    """Deployments share the accelerators: one that does not fit is PENDING with what is missing,
    never takes a running one's; room freed by shrinking one goes to the one that waited longest."""
    ctl = await harness.start()
    await harness.register("node-a", accelerators=2)
    ctl.apply_deployment(chat())  # two instances: both accelerators
    ctl.reconcile_once()
    await async_wait_for(lambda: len(harness.client.starts()) == 2, timeout=5, what="chat's engines started")
    ctl.apply_deployment(embed())
    ctl.reconcile_once()
    waiting = harness.instance("embed-0")
    assert waiting.state == C.INSTANCE_STATE_PENDING
    assert "rank 0 needs 1 accelerator(s)" in waiting.reason and "0/2 accelerators" in waiting.reason, waiting.reason
    assert not harness.client.stops() and harness.instance("chat-0").state != C.INSTANCE_STATE_PENDING
    later = small_deployment([{"name": "a-late", "role": "union"}], name="late")  # its id sorts first
    ctl.apply_deployment(later)
    ctl.reconcile_once()
    assert harness.instance("a-late-0").state == C.INSTANCE_STATE_PENDING
    summary = {d.deployment.name: d.pending_instances for d in ctl.list_deployments().deployments}
    assert summary == {"chat": 0, "embed": 1, "late": 1}

    ctl.apply_deployment(
        small_deployment([{"name": "chat", "role": "union", "count": 1}], name="chat", model="sim-chat")
    )
    await async_wait_for(lambda: len(harness.client.stops()) == 1, timeout=5, what="chat-1 stopped")
    harness.beat("node-a")  # the node reports it gone: its accelerator is free
    ctl.reconcile_once()
    assert harness.instance("embed-0").state == C.INSTANCE_STATE_STARTING  # applied before `late`: first
    assert harness.instance("a-late-0").state == C.INSTANCE_STATE_PENDING


async def test_endpoints_carry_their_deployment_and_model_and_filter_by_model(harness):
    """A router routes by the request's `model`: each endpoint names its deployment and the model
    it serves; ListEndpoints and the WatchEndpoints stream filter by model."""
    from controller.routing import endpoints

    ctl = await two_running(harness)
    feed = ctl.endpoints.subscribe()
    await anext(feed)
    harness.client.set_health("node-a")
    harness.beat("node-a")
    await async_wait_for(lambda: len(ctl.list_endpoints()) == 3, timeout=5, what="three endpoints")
    by_engine = {e.engine_id: (e.deployment, list(e.models)) for e in ctl.list_endpoints()}
    assert by_engine == {
        "chat-0/rank0": ("chat", ["sim-chat"]),
        "chat-1/rank0": ("chat", ["sim-chat"]),
        "embed-0/rank0": ("embed", ["sim-embed"]),
    }
    assert [e.engine_id for e in ctl.list_endpoints(model="sim-embed")] == ["embed-0/rank0"]
    assert ctl.list_endpoints(model="llama-70b") == []
    paged = ctl.page_endpoints(C.ListEndpointsRequest(model="sim-chat", filter="instance_id=chat-1"))
    assert [e.engine_id for e in paged.endpoints] == ["chat-1/rank0"]
    assert [e.engine_id for e in ctl.page_endpoints(C.ListEndpointsRequest(filter="deployment=embed")).endpoints] == [
        "embed-0/rank0"
    ]

    added = []
    while len(added) < 3:
        added += (await asyncio.wait_for(anext(feed), 5)).added
    ctl.delete_deployment("chat")
    removed = []
    while len(removed) < 2:  # one change per instance removed
        change = await asyncio.wait_for(anext(feed), 5)
        assert endpoints.of_role(change, 0, "sim-embed") is None  # nothing of embed's changed
        removed += [e.engine_id for e in endpoints.of_role(change, 0, "sim-chat").removed]
    assert sorted(removed) == ["chat-0/rank0", "chat-1/rank0"]
    feed.close()


async def test_the_second_model_example_runs_beside_the_local_example(harness):
    """examples/second-model.yaml applies beside examples/local-deployment.yaml (as docs show)."""
    from motor.contract.deployment_file import load_deployment
    from tests.support.controller_harness import EXAMPLE

    ctl = await harness.start()
    await harness.register("node-a", accelerators=4)
    await harness.register("node-b", accelerators=4)
    ctl.apply_deployment(load_deployment(EXAMPLE))
    ctl.apply_deployment(load_deployment(EXAMPLE.replace("local-deployment.yaml", "second-model.yaml")))
    ctl.reconcile_once()
    assert {d.deployment.name: d.instances for d in ctl.list_deployments().deployments} == {
        "local-sim": 2,
        "small-sim": 2,
    }
    assert all(i.state == C.INSTANCE_STATE_STARTING for i in ctl.instances.values())  # all placed: 5 of 8 accelerators


async def test_watch_events_follows_one_deployment(harness, served):
    """Each deployment keeps its own events: a stream for one sends its instances and events only,
    also those about an instance or engine that name no deployment where they are raised."""
    ctl = harness.controller
    await harness.register("node-a", accelerators=4)
    ctl.apply_deployment(chat())
    ctl.apply_deployment(embed())
    ctl.reconcile_once()
    await async_wait_for(lambda: len(harness.client.starts()) == 3, timeout=5, what="the three engines started")

    stream = served.WatchEvents(C.WatchEventsRequest(deployment="embed"))
    first = await stream.read()
    assert [i.instance_id for i in first.snapshot.instances] == ["embed-0"]
    assert first.snapshot.recent_events and {e.deployment for e in first.snapshot.recent_events} == {"embed"}
    assert len(first.snapshot.nodes) == 1  # nodes are shared: every node

    ctl.state.event(C.EVENT_TYPE_RETRYING, "about chat's engine", engine_id="chat-0/rank0")
    ctl.state.event(C.EVENT_TYPE_RETRYING, "about embed's engine", engine_id="embed-0/rank0")
    ctl.apply_deployment(chat(restart_policy={"max_failures": 2}))
    ctl.apply_deployment(embed(restart_policy={"max_failures": 2}))
    got = [(await stream.read()).event]
    while not got[-1].message.startswith("deployment 'embed' applied (revision 2"):
        got.append((await stream.read()).event)
    assert got[0].message == "about embed's engine"
    assert not [e.message for e in got if "chat" in e.message]
    assert {e.deployment for e in got} == {"embed"}
    stream.cancel()

    everything = served.WatchEvents(C.WatchEventsRequest())
    assert {e.deployment for e in (await everything.read()).snapshot.recent_events} >= {"chat", "embed"}
    everything.cancel()


async def test_watch_events_of_a_bad_deployment_name_is_invalid_argument(served):
    stream = served.WatchEvents(C.WatchEventsRequest(deployment="Not A Name"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stream.read()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("deployment 'Not A Name' must be 1-63 lowercase letters")
