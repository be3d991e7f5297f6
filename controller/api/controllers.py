"""What the gRPC server and the servicer ask of this process's controller, the same whether it
runs alone on SQLite (`SingleController`) or as one of several on etcd
(`controller.ha.high_availability.HighAvailability`): the `Controller` to answer from now, whether
it leads, the gate its server runs inside its calls, and how it starts acting and stops."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry

from controller.core import Controller
from motor.service.server_calls import Gate
from motor.v1 import controller_pb2

if TYPE_CHECKING:
    from controller.store.sqlite import SqliteStore


class Controllers(Protocol):
    @property
    def controller(self) -> Controller:
        """The controller the servicer answers from: the acting one, or a standby's view."""
        ...

    def is_leader(self) -> bool: ...

    def standby_view(self) -> str:
        """What a standby's read answer says of itself (asked only when not leading)."""
        ...

    async def list_controllers(self) -> controller_pb2.ListControllersResponse: ...

    def metrics_registry(self) -> CollectorRegistry:
        """The registry of the controller in use now."""
        ...

    def gate(self) -> Gate | None:
        """What the server runs inside its calls (after their access checks) for this controller."""
        ...

    def campaign(self, address: str) -> None:
        """Start acting, the gRPC server listening on `address`."""
        ...

    async def resign(self) -> None:
        """Stop acting, before the gRPC server stops (nothing acts while the port refuses)."""
        ...

    async def stop(self) -> None:
        """Release everything, once the gRPC server has stopped."""
        ...


class SingleController:
    """One controller on SQLite: it always leads (epoch 0) and acts from its start."""

    def __init__(self, controller: Controller, store: SqliteStore | None = None):
        self._controller, self.store = controller, store  # the store is closed by stop()

    @property
    def controller(self) -> Controller:
        return self._controller

    def is_leader(self) -> bool:
        return True

    def standby_view(self) -> str:
        return ""

    async def list_controllers(self) -> controller_pb2.ListControllersResponse:
        config = self._controller.config
        return controller_pb2.ListControllersResponse(
            leader_address=config.listen,
            store=f"sqlite:///{os.path.abspath(config.db)}",
            controllers=[controller_pb2.ControllerMember(address=config.listen, name=config.listen, leader=True)],
        )

    def metrics_registry(self) -> CollectorRegistry:
        return self._controller.metrics.registry

    def gate(self) -> Gate | None:
        return None  # it always leads: every call is its to answer

    def campaign(self, address: str) -> None:
        pass  # acting since start()

    async def resign(self) -> None:
        pass  # acts until stop(): nothing else would

    async def stop(self) -> None:
        await self._controller.stop()
        if self.store is not None:
            self.store.close()
