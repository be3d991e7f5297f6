from __future__ import annotations

import grpc
import pytest

from controller.api.controllers import SingleController
from controller.api.servicer import ControllerServicer
from motor.service.grpc_server import MotorServer, service_name
from motor.v1 import controller_pb2, controller_pb2_grpc
from tests.support.controller_harness import Harness


@pytest.fixture
async def harness(tmp_path):
    h = Harness(tmp_path)
    yield h
    await h.stop()


@pytest.fixture
async def served(harness):
    """The harness's controller behind a real gRPC server; yields a stub on a real channel."""
    await harness.start()
    server = MotorServer("127.0.0.1:0")
    server.add(
        controller_pb2_grpc.add_ControllerServiceServicer_to_server,
        ControllerServicer(SingleController(harness.controller)),
        service_name(controller_pb2, "ControllerService"),
    )
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield controller_pb2_grpc.ControllerServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(grace=0)
