"""A node manager whose registration the controller refuses (INVALID_ARGUMENT, e.g. its node id)
stops with one clear message instead of retrying forever; its own config check applies the same
id rule at start-up."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from motor.contract.names import check_node_id
from motor.errors import InvalidArgument
from motor.v1 import controller_pb2, controller_pb2_grpc
from node_manager.controller_link import RegistrationRefused
from tests.support.node_manager_fakes import ScriptedController, link  # noqa: F401 (fixtures)
from tests.support.node_manager_harness import node_manager_process, serve_controller


async def test_invalid_argument_on_register_is_fatal_after_one_call(link):  # noqa: F811
    controller: ScriptedController = link.stub
    controller.errors["RegisterNode"] = [grpc.StatusCode.INVALID_ARGUMENT] * 5
    with pytest.raises(
        RegistrationRefused,
        match=r"the controller refused to register node 'node-f': scripted INVALID_ARGUMENT "
        r"\(node ids must be 1-63 lowercase letters.*\); not retrying",
    ):
        await asyncio.wait_for(link.run(), timeout=60)
    assert len(controller.times("RegisterNode")) == 1


class RefusingController(controller_pb2_grpc.ControllerServiceServicer):
    """A controller whose id rule is stricter than the node manager's: it refuses `refused`."""

    def __init__(self, refused: str):
        self.refused = refused
        self.registrations = 0

    async def RegisterNode(self, request, context):
        self.registrations += 1
        if request.node.node_id == self.refused:
            raise InvalidArgument(f"node.node_id {request.node.node_id!r} is not allowed by this controller")
        check_node_id(request.node.node_id, "node.node_id")
        return controller_pb2.RegisterNodeResponse(generation=1)


@pytest.mark.processes
async def test_a_node_manager_the_controller_refuses_stops_with_a_clear_message(tmp_path):
    controller = RefusingController("node-x")
    server, address = await serve_controller(controller)
    process = node_manager_process(tmp_path, "--node-id", "node-x", "--controller", address)
    try:
        output, _ = await asyncio.to_thread(process.communicate, timeout=60)  # a hang fails here
    finally:
        if process.poll() is None:
            process.kill()
        await server.stop(grace=0)
    assert process.returncode == 2, output
    assert controller.registrations == 1, output
    assert (
        "the controller refused to register node 'node-x': node.node_id 'node-x' is not allowed by this controller"
        in output
    )
    assert "node ids must be 1-63 lowercase letters" in output


@pytest.mark.parametrize("node_id", ["Node-A", "node a"])
@pytest.mark.processes
def test_a_node_id_outside_the_rule_is_refused_at_start_up(tmp_path, node_id):
    process = node_manager_process(tmp_path, "--node-id", node_id, "--controller", "127.0.0.1:1")
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 2, output
    assert (
        "node_id: must be 1-63 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit (got "
        f"{node_id!r})" in output
    )
