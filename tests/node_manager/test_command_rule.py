"""Which controller commands a node manager obeys (node_manager/controller_epoch.py): the
controller it reports to is the authority; a command teaches nothing, so one bogus StartEngine
(plaintext: anyone can send it) cannot poison the node."""

from __future__ import annotations

import grpc
import pytest

from motor.errors import FailedPrecondition, Unavailable
from motor.v1 import node_manager_pb2, types_pb2
from node_manager.controller_epoch import ControllerEpoch
from tests.support import async_wait_for
from tests.support.node_manager_harness import spec

RUNNING = types_pb2.ENGINE_STATE_RUNNING


def test_replies_set_the_epoch_and_commands_teach_nothing():
    epoch = ControllerEpoch()
    epoch.admit(2**63, "before any reply")  # a standalone node manager: nothing to compare with
    epoch.observe(5, generation_limit=100)
    for bogus in (2**63, 7):
        with pytest.raises(
            Unavailable, match=rf"^controller_epoch {bogus} refused .*announced epoch 5; a leader of a later"
        ):
            epoch.admit(bogus, "StartEngine of x-0/rank0")
    with pytest.raises(FailedPrecondition, match="^controller_epoch 4 refused .*epoch 5 leads now"):
        epoch.admit(4, "StopEngine of x-0/rank0")
    epoch.admit(6, "a new leader whose reply has not arrived yet")
    epoch.admit(5, "the current leader")  # the one-step-ahead command did not raise the epoch
    epoch.admit(0, "grpcurl by hand, a controller without high availability")
    assert epoch.current == 5
    epoch.observe(1)  # a new store's first leader: its reply is the authority
    epoch.admit(1, "it")
    with pytest.raises(Unavailable):
        epoch.admit(5, "the lost store's leader")


def test_a_start_above_the_announced_generation_limit_is_refused_until_the_next_reply():
    epoch = ControllerEpoch()
    epoch.admit_generation(2**63, "no controller yet: unchecked")
    epoch.observe(0, generation_limit=100)
    epoch.admit_generation(100, "at the limit")
    with pytest.raises(Unavailable, match=r"^spec.generation 101 refused .*above the limit 100"):
        epoch.admit_generation(101, "StartEngine of x-0/rank0")
    epoch.observe(0, generation_limit=200)
    epoch.admit_generation(101, "after the next heartbeat")


@pytest.mark.processes
async def test_a_node_under_a_controller_refuses_bogus_commands_and_obeys_the_real_ones(make_node, fake_controller):
    fake_controller.epoch, fake_controller.generation_limit = 3, 1000
    node = await make_node(controller=fake_controller.address)
    await async_wait_for(lambda: fake_controller.heartbeats, timeout=10, what="a heartbeat")
    for request, code, field in (
        (
            node_manager_pb2.StartEngineRequest(spec=spec(generation=2**63), controller_epoch=3),
            grpc.StatusCode.UNAVAILABLE,
            "spec.generation",
        ),
        (
            node_manager_pb2.StartEngineRequest(spec=spec(generation=5), controller_epoch=2**63),
            grpc.StatusCode.UNAVAILABLE,
            "controller_epoch",
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await node.stub.StartEngine(request)
        assert refused.value.code() == code and refused.value.details().startswith(field), refused.value.details()
    assert not node.manager.records  # nothing ran, nothing was remembered
    real = await node.stub.StartEngine(node_manager_pb2.StartEngineRequest(spec=spec(generation=5), controller_epoch=3))
    assert real.engine.spec.generation == 5
    await node.wait_state("prefill-0/rank0", RUNNING)


@pytest.mark.processes
async def test_a_new_store_keeps_what_the_node_runs_and_learns_its_highest_generation(make_node, fake_controller):
    node = await make_node(controller=fake_controller.address)
    await async_wait_for(lambda: fake_controller.registrations, timeout=10, what="registered")
    engine = await node.start(generation=41)
    await node.wait_state("prefill-0/rank0", RUNNING)
    # The controller comes back on a new store: it assigns nothing, and says so.
    fake_controller.assignments, fake_controller.keep_unassigned = [], True
    fake_controller.refuse_heartbeats = 1
    await async_wait_for(lambda: len(fake_controller.registrations) >= 2, timeout=10, what="registered again")
    assert fake_controller.registrations[1].highest_generation == 41
    await async_wait_for(lambda: len(fake_controller.heartbeats) >= 3, timeout=10, what="heartbeats after it")
    kept = await node.get("prefill-0/rank0")
    assert kept.state == RUNNING and kept.pid == engine.pid
