"""The CPU the controller's own code spends per heartbeat and per engine report
(motor_controller_handling_cpu_seconds_total{call}): what bench/controller_scale.py judges apart
from gRPC's share, so it must count every call and nothing of other calls."""

from __future__ import annotations

from controller.api.controllers import SingleController
from controller.api.servicer import ControllerServicer
from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T
from tests.support.controller_fakes import ManualClock
from tests.support.controller_harness import Harness, node_info


def cpu(ctl, call: str) -> float:
    return ctl.metrics.registry.get_sample_value("motor_controller_handling_cpu_seconds_total", {"call": call})


async def test_each_heartbeat_and_report_adds_its_own_handling_cpu_to_its_own_call(tmp_path):
    clock = ManualClock()
    h = Harness(tmp_path, clock=clock, heartbeat_interval=1, node_grace=5)
    servicer = ControllerServicer(SingleController(ctl := await h.start()))
    try:
        reply = await servicer.RegisterNode(C.RegisterNodeRequest(node=node_info("node-a")), None)
        assert cpu(ctl, "heartbeat") == 0.0 and cpu(ctl, "report") == 0.0  # registering is neither
        beat = C.HeartbeatRequest(node_id="node-a", generation=reply.generation)
        for _ in range(200):
            clock.advance(1.0)
            await servicer.Heartbeat(beat, None)
        per_beat = cpu(ctl, "heartbeat") / 200
        assert 0 < per_beat < 0.01, per_beat  # counted, and a beat's own handling, not the process's
        assert cpu(ctl, "report") == 0.0

        engine = T.Engine(engine_id="decode-0/rank0", state=T.ENGINE_STATE_FAILED)
        report = C.ReportEngineEventRequest(node_id="node-a", generation=reply.generation, engine=engine, reason="x")
        await servicer.ReportEngineEvent(report, None)
        assert 0 < cpu(ctl, "report") < 0.25  # (a first report may also pay a collection or a first-use import)
        assert cpu(ctl, "heartbeat") == per_beat * 200  # the report added nothing to the beats' count
    finally:
        await h.stop()
