"""motor.v1.EngineService: a thin translation between protobuf and EngineServer."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from engine_server.probing import ProbeRecord
from engine_server.server import EngineServer, StatusSnapshot
from motor.contract import pbtime
from motor.contract.names import ROLES_BY_NAME
from motor.v1 import engine_pb2, engine_pb2_grpc, types_pb2

logger = logging.getLogger(__name__)


def probe_to_proto(record: ProbeRecord) -> types_pb2.ProbeResult:
    return types_pb2.ProbeResult(
        time=pbtime.timestamp(record.time),
        outcome=types_pb2.PROBE_OUTCOME_SUCCESS if record.success else types_pb2.PROBE_OUTCOME_FAILURE,
        latency=pbtime.duration(record.latency),
        error=record.error,
        utilization_peak=record.utilization_peak,
        next_interval=pbtime.duration(record.next_interval),
        consecutive_failures=record.consecutive_failures,
        status=int(record.status),
        counted=record.counted,
    )


def status_to_proto(status: StatusSnapshot) -> types_pb2.EngineStatus:
    message = types_pb2.EngineStatus(
        status=int(status.health),
        reason=status.reason,
        engine_type=status.engine_type,
        role=ROLES_BY_NAME.get(status.role, types_pb2.ROLE_UNSPECIFIED),
        instance_id=status.instance_id,
        dp_rank=status.dp_rank,
        sleeping=status.sleeping,
        draining=status.draining,
        probing=status.probing,
        consecutive_failures=status.consecutive_failures,
        probe_interval=pbtime.duration(status.probe_interval),
        in_flight_requests=status.in_flight_requests,
        in_flight_average=status.in_flight_average,
        stop_grace=pbtime.duration(status.stop_grace),
        not_serving_reason=status.not_serving_reason,
    )
    if status.last_probe is not None:
        message.last_probe.CopyFrom(probe_to_proto(status.last_probe))
    return message


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, server: EngineServer):
        self.server = server

    async def GetStatus(self, request, context):
        return engine_pb2.GetStatusResponse(status=status_to_proto(self.server.get_status()))

    async def WatchProbes(self, request, context) -> AsyncIterator[engine_pb2.WatchProbesResponse]:
        events = self.server.subscribe()
        try:
            async for event in events:
                message = engine_pb2.WatchProbesResponse(status=status_to_proto(event.status))
                if event.probe is not None:
                    message.probe.CopyFrom(probe_to_proto(event.probe))
                yield message
        finally:
            events.close()

    async def Drain(self, request, context):
        deadline = pbtime.seconds(request.deadline) if request.HasField("deadline") else None
        drained, left = await self.server.drain(deadline)
        return engine_pb2.DrainResponse(drained=drained, in_flight_requests=left)

    async def Sleep(self, request, context):
        return engine_pb2.SleepResponse(status=status_to_proto(await self.server.sleep(request.level)))

    async def WakeUp(self, request, context):
        return engine_pb2.WakeUpResponse(status=status_to_proto(await self.server.wake_up()))


def register(motor_server, engine_server: EngineServer) -> None:
    """Add EngineService to a motor.service.grpc_server.MotorServer."""
    motor_server.add(
        engine_pb2_grpc.add_EngineServiceServicer_to_server,
        EngineServicer(engine_server),
        engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name,
    )
