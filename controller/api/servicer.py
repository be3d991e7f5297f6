"""motor.v1.ControllerService: translates protobuf to Controller calls (behaviour lives in core)."""

from __future__ import annotations

import logging
import time

from controller.api.controllers import Controllers
from controller.core import Controller
from controller.model.events import concerns
from controller.routing import endpoints
from motor.contract import pbtime
from motor.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from motor.v1 import controller_pb2, controller_pb2_grpc

logger = logging.getLogger(__name__)
# Refusals whose message starts with the field of the request it is about (not UNAVAILABLE: a standby's).
ABOUT_THE_REQUEST = (InvalidArgument, NotFound, FailedPrecondition, ResourceExhausted)


class ControllerServicer(controller_pb2_grpc.ControllerServiceServicer):
    def __init__(self, controllers: Controllers):
        self.controllers = controllers

    @property
    def controller(self) -> Controller:
        """With etcd: the leader's Controller or a standby's read-only view, in turn."""
        return self.controllers.controller

    async def RegisterNode(self, request, context):
        reply = await self.controller.register_node(request.node, request.engines, request.highest_generation)
        interval, grace = self.controller.monitor.announce(request.node.node_id)  # its silence is judged by these
        reply.heartbeat_interval.CopyFrom(interval)
        reply.node_grace.CopyFrom(grace)
        return reply

    def _heartbeat(self, request: controller_pb2.HeartbeatRequest) -> controller_pb2.HeartbeatResponse:
        started, cpu = time.perf_counter(), time.thread_time()
        controller = self.controller  # (looked up once: the hot path, 2,000 beats a second at the budget)
        controller.pacing.admit(request.node_id)  # far faster than told: refused before it is read
        controller.heartbeat(
            request.node_id,
            request.generation,
            request.engines,
            request.delta,
            request.removed_engine_ids,
            request.store_failing,
        )
        metrics = controller.metrics
        metrics.heartbeat_seconds.observe(time.perf_counter() - started)
        # The rate budget: it changes with the fleet's size; this node is judged by what it is told.
        interval, grace = controller.monitor.announce(request.node_id)
        reply = controller_pb2.HeartbeatResponse(
            sequence=request.sequence,
            generation_limit=controller.generations.limit(),
            heartbeat_interval=interval,
            node_grace=grace,
        )
        metrics.heartbeat_cpu.inc(time.thread_time() - cpu)
        return reply

    async def Heartbeat(self, request, context):
        return self._heartbeat(request)

    async def StreamHeartbeats(self, request_iterator, context):
        # The same handling as Heartbeat, one answer per beat; a refused beat ends the stream
        # with Heartbeat's status (the node registers again and opens a new stream).
        async for request in request_iterator:
            try:
                reply = self._heartbeat(request.heartbeat)
            except ABOUT_THE_REQUEST as exc:  # the fields it names are those of the message's `heartbeat`
                raise type(exc)(f"heartbeat.{exc}") from None
            yield controller_pb2.StreamHeartbeatsResponse(heartbeat=reply)

    async def ReportEngineEvent(self, request, context):
        cpu = time.thread_time()
        self.controller.report_engine_event(request.node_id, request.generation, request.engine, request.reason)
        self.controller.metrics.report_cpu.inc(time.thread_time() - cpu)
        return controller_pb2.ReportEngineEventResponse()

    async def ApplyDeployment(self, request, context):
        if not request.HasField("deployment"):
            raise InvalidArgument("deployment: required")
        if request.dry_run:
            deployment, revision = self.controller.dry_run_apply(request.deployment)
            return controller_pb2.ApplyDeploymentResponse(deployment=deployment, revision=revision, dry_run=True)
        deployment, revision = await self.controller.apply(request.deployment)
        return controller_pb2.ApplyDeploymentResponse(deployment=deployment, revision=revision)

    async def GetDeployment(self, request, context):
        deployment, revision = self.controller.get_deployment(request.name)
        return controller_pb2.GetDeploymentResponse(deployment=deployment, revision=revision)

    async def DeleteDeployment(self, request, context):
        await self.controller.delete(request.name)
        return controller_pb2.DeleteDeploymentResponse()

    async def PauseRollout(self, request, context):
        await self.controller.rollouts.pause_durably(request.name)
        return controller_pb2.PauseRolloutResponse()

    async def ResumeRollout(self, request, context):
        await self.controller.rollouts.resume_durably(request.name)
        return controller_pb2.ResumeRolloutResponse()

    async def UndoRollout(self, request, context):
        deployment, revision = await self.controller.rollouts.undo(request.name)
        return controller_pb2.UndoRolloutResponse(deployment=deployment, revision=revision)

    async def ListDeployments(self, request, context):
        return self.controller.list_deployments()

    async def ListNodes(self, request, context):
        return self._marked(self.controller.page_nodes(request))

    async def ListInstances(self, request, context):
        return self._marked(self.controller.page_instances(request))

    async def ListEndpoints(self, request, context):
        return self._marked(self.controller.page_endpoints(request))

    def _marked(self, reply):
        """A standby's answer says it is one (its view lacks liveness, engine state and health)."""
        if not self.controllers.is_leader():
            reply.standby_view = self.controllers.standby_view()
        return reply

    async def WatchEndpoints(self, request, context):
        await self.controller.engines_heard()
        changes = self.controller.endpoints.subscribe()
        try:
            async for message in changes:
                message = endpoints.of_role(message, request.role, request.model)
                if message is not None:
                    yield message
        finally:
            changes.close()

    async def ListControllers(self, request, context):
        return await self.controllers.list_controllers()

    async def ReportFrontDoor(self, request, context):
        self.controller.front_doors.report(
            request.router,
            request.worker_urls,
            request.router_answering,
            pbtime.seconds(request.report_interval),
            request.sync_instance,
            request.router_restarts,
        )
        return controller_pb2.ReportFrontDoorResponse()

    async def WatchEvents(self, request, context):
        snapshot = self.controller.snapshot(request.deployment)
        events = self.controller.events.subscribe()  # with the snapshot, so no event falls between the two
        try:
            yield controller_pb2.WatchEventsResponse(snapshot=snapshot)
            async for event in events:
                if concerns(event, request.deployment):
                    yield controller_pb2.WatchEventsResponse(event=event)
        finally:
            events.close()
