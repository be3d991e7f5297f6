"""docs/clients.md, engine server section: each documented grpcurl command against a real
engine server (sim engine) started as the document starts it."""

from __future__ import annotations

import grpc
import pytest

from motor.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.support import wait_for
from tests.support.grpcurl_services import start_engine_server
from tests.support.grpcurl_walkthrough import load_steps, run_step

STEPS = [step for step in load_steps() if step.section == "engine"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    service, address = start_engine_server(str(tmp_path_factory.mktemp("engine")))
    try:
        with grpc.insecure_channel(address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)

            def serving():  # NORMAL, and virtual inference started (a moment after NORMAL)
                status = stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=2).status
                return status.status == types_pb2.HEALTH_STATUS_NORMAL and status.probing

            wait_for(serving, timeout=60, interval=0.2, what="engine server NORMAL and probing")
        yield {"engine": address}
    finally:
        service.stop()


@pytest.mark.parametrize("step", STEPS, ids=[step.id for step in STEPS])
def test_documented_engine_command(engine, step):
    run_step(step, engine)
