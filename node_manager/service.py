"""motor.v1.NodeManagerService: a thin translation between protobuf and NodeManager."""

from __future__ import annotations

from motor.contract import pbtime, start_refusals
from motor.contract.names import excerpt
from motor.errors import InvalidArgument
from motor.v1 import node_manager_pb2, node_manager_pb2_grpc, types_pb2
from node_manager.controller_epoch import ControllerEpoch
from node_manager.manager import NodeManager

# A graceful stop longer than an hour is a mistake (or an attack); larger values are refused.
MAX_STOP_DEADLINE = 3600.0


class NodeManagerServicer(node_manager_pb2_grpc.NodeManagerServiceServicer):
    def __init__(
        self,
        manager: NodeManager,
        process: types_pb2.NodeManagerProcess | None = None,
        epoch: ControllerEpoch | None = None,
    ):
        self.manager = manager
        self.process = process or types_pb2.NodeManagerProcess()
        self.epoch = epoch or ControllerEpoch()

    def _for_this_node(self, node_id: str) -> None:
        """Refuse a command meant for another node: whoever sent it has that node registered at
        this node's address (a wrong --advertise-address, or a stolen node certificate)."""
        if node_id and node_id != self.manager.node_id:
            raise start_refusals.wrong_node(excerpt(node_id), self.manager.node_id)

    async def StartEngine(self, request, context):
        if not request.HasField("spec"):
            raise InvalidArgument("spec: required (instance_id, dp_rank, role, config_path or config_json, ...)")
        what = f"StartEngine of {request.spec.instance_id}/rank{request.spec.dp_rank}"
        self._for_this_node(request.node_id)
        await self.manager.wait_for_claim()  # registering: its reply says which epoch and limit are current
        self.epoch.admit(request.controller_epoch, what)
        self.epoch.admit_generation(request.spec.generation, what)
        record = await self.manager.start_engine(request.spec)
        return node_manager_pb2.StartEngineResponse(engine=record.to_proto(self.manager.node_id))

    async def StopEngine(self, request, context):
        deadline = None
        if request.HasField("deadline"):
            deadline = pbtime.seconds(request.deadline)
            if not 0 <= deadline <= MAX_STOP_DEADLINE:
                raise InvalidArgument(f"deadline must be within 0-{MAX_STOP_DEADLINE:g}s (got {deadline:g}s)")
        self._for_this_node(request.node_id)
        self.epoch.admit(request.controller_epoch, f"StopEngine of {request.engine_id}")
        record = await self.manager.stop_engine(request.engine_id, deadline, request.generation)
        return node_manager_pb2.StopEngineResponse(engine=record.to_proto(self.manager.node_id))

    async def GetEngine(self, request, context):
        record = self.manager.get(request.engine_id)
        return node_manager_pb2.GetEngineResponse(engine=record.to_proto(self.manager.node_id))

    async def ListEngines(self, request, context):
        self._for_this_node(request.node_id)
        return node_manager_pb2.ListEnginesResponse(engines=self.manager.engines(), process=self.process)

    async def WatchEngines(self, request, context):
        async for engine, snapshot in self.manager.watch():
            yield node_manager_pb2.WatchEnginesResponse(engine=engine, snapshot=snapshot)
