"""The node manager's side of node id conflicts, with real sim engines and a fake controller:
refused (another process holds the node id), taking the node id over, the state directory lock."""

from __future__ import annotations

import logging

import grpc
import pytest

from motor.errors import ConfigError
from motor.v1 import types_pb2
from node_manager.process_identity import boot_id, state_dir_id
from tests.support import async_wait_for
from tests.support.node_manager_harness import alive

RUNNING, STOPPED = types_pb2.ENGINE_STATE_RUNNING, types_pb2.ENGINE_STATE_STOPPED
HELD = "node id 'node-a' is held by another live node manager: 127.0.0.1:9 (pid 1 on host elsewhere)"


async def test_registration_carries_the_process_identity(make_node, fake_controller):
    node = await make_node(controller=fake_controller.address)
    first = await async_wait_for(lambda: fake_controller.registrations, timeout=10)
    process = first[0].node.process
    assert process.boot_id == boot_id() and process.nonce and process.state_dir_id
    assert process.pid > 0 and process.HasField("started_at")
    with open(f"{node.server.config.state_dir}/node_manager.id", encoding="ascii") as handle:
        assert handle.read().strip() == process.state_dir_id


@pytest.mark.processes
async def test_a_refused_node_manager_stops_its_engines_says_so_and_starts_nothing(make_node, fake_controller, caplog):
    caplog.set_level(logging.ERROR, logger="node_manager.controller_link")
    node = await make_node(controller=fake_controller.address)
    await async_wait_for(lambda: fake_controller.registrations, timeout=10)
    await node.start(accelerator_ids=[0])
    engine = await node.wait_state("prefill-0/rank0", RUNNING)

    fake_controller.refuse_registrations = HELD
    fake_controller.refuse_heartbeats = 1  # the node id was taken over: this process's generation is stale
    stopped = await node.wait_state("prefill-0/rank0", STOPPED)
    assert "fenced: node id node-a is held by another node manager process" in stopped.state_reason
    assert not alive(engine.pid)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await node.start(dp_rank=1, accelerator_ids=[1])
    assert (
        refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        and "not starting anything" in refused.value.details()
    )
    assert HELD in refused.value.details()
    lines = [r.getMessage() for r in caplog.records if "is held by another live node manager" in r.getMessage()]
    assert lines and "node id node-a" in lines[0] and "127.0.0.1:9" in lines[0]
    count = len(fake_controller.registrations)
    await async_wait_for(lambda: len(fake_controller.registrations) >= count + 3, timeout=10, what="asking again")

    fake_controller.refuse_registrations = ""  # the holder is gone: this one holds the node id now
    await async_wait_for(lambda: node.manager.claim_held.is_set(), timeout=10, what="registered")
    await node.start(dp_rank=1, accelerator_ids=[1])


@pytest.mark.processes
async def test_taking_the_node_id_over_kills_what_the_old_holder_left_on_this_host(
    make_node, fake_controller, tmp_path
):
    old = await make_node(state_dir=str(tmp_path / "old"))  # the holder, standalone here
    left = await old.start(accelerator_ids=[0])
    await old.wait_state("prefill-0/rank0", RUNNING)
    await old.server.stop()  # gone; its engine keeps running, supervised by nobody
    assert alive(left.pid)
    # Another cluster's node manager on this host uses the same node id: its engine is not ours to kill.
    bystander = await make_node(state_dir=str(tmp_path / "bystander"))
    theirs = await bystander.start(accelerator_ids=[1])
    await bystander.wait_state("prefill-0/rank0", RUNNING)

    holder = state_dir_id(str(tmp_path / "old"))
    fake_controller.replaced = types_pb2.NodeManagerProcess(boot_id=boot_id(), state_dir_id=holder, nonce="old", pid=1)
    new = await make_node(state_dir=str(tmp_path / "new"), controller=fake_controller.address)
    await async_wait_for(lambda: new.manager.claim_held.is_set(), timeout=30, what="registered")
    assert not alive(left.pid)  # killed before the registration counts as done
    assert alive(theirs.pid), "a takeover killed an engine of another node manager than the replaced holder"
    await new.start(accelerator_ids=[0])
    await new.wait_state("prefill-0/rank0", RUNNING)


async def test_a_second_node_manager_on_the_same_state_dir_stops_at_start(make_node, tmp_path):
    await make_node(state_dir=str(tmp_path / "shared"))
    with pytest.raises(ConfigError, match=r"state_dir: .*shared is in use by another node manager \(pid \d+"):
        await make_node(node_id="node-b", state_dir=str(tmp_path / "shared"))
