"""Telling the controller what the router routes to (ReportFrontDoor), on the followed controller's
channel: after each pass that changed or re-read the router's list, and at least every
`interval` as a sign of life (the controller turns a silent front door stale after 3 intervals,
and rollouts then count no engine available through it: controller/routing/door_reports.py).

A controller that refuses the report (an older one: UNIMPLEMENTED; an access table without it:
PERMISSION_DENIED) is said once; the sync goes on keeping the router either way.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

import grpc
from google.protobuf import duration_pb2

from motor.v1 import controller_pb2, controller_pb2_grpc
from router_sync.sync import RouterSync

logger = logging.getLogger(__name__)


class FrontDoorReporter:
    def __init__(self, sync: RouterSync, announce: Callable[[str], None], interval: float = 2.0):
        self.sync, self.announce, self.interval = sync, announce, interval
        self.instance = uuid.uuid4().hex  # a new one at each start: the controller sees a restart
        self.sent = 0  # reports the controller took (tests wait on it)
        self._refused: str | None = None

    def request(self) -> controller_pb2.ReportFrontDoorRequest | None:
        """What the router holds now; None before the sync has read the router's list once."""
        sync = self.sync
        answering = not sync.router_down.count
        if answering and sync.held is None:
            return None  # not read yet: before Motor's first list
        return controller_pb2.ReportFrontDoorRequest(
            router=sync.admin.base_url,
            worker_urls=sorted(sync.held or ()) if answering else [],
            router_answering=answering,
            report_interval=duration_pb2.Duration(seconds=int(self.interval), nanos=int(self.interval % 1 * 1e9)),
            sync_instance=self.instance,
            router_restarts=sync.router_restarts,
        )

    async def run(self, channel: grpc.aio.Channel) -> None:
        """Reports until cancelled (the stream of this channel ended)."""
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        while True:
            self.sync.changed.clear()
            request = self.request()
            if request is not None:
                await self._send(stub, request)
            try:
                await asyncio.wait_for(self.sync.changed.wait(), self.interval)
            except TimeoutError:
                pass

    async def _send(self, stub: controller_pb2_grpc.ControllerServiceStub, request) -> None:
        try:
            await stub.ReportFrontDoor(request, timeout=max(1.0, self.interval))
        except grpc.aio.AioRpcError as exc:
            why = f"{exc.code().name}: {exc.details()}"
            if why != self._refused:
                self._refused = why
                self.announce(
                    f"the controller did not take this router's report (ReportFrontDoor {why}); it cannot tell "
                    "what the router routes to. Retrying every report interval"
                )
            return
        if self._refused is not None:
            self.announce("the controller takes this router's reports again")
            self._refused = None
        self.sent += 1
