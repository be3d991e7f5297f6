"""Wiring of one node manager: the behaviour, its gRPC server, the controller link, metrics.

Tests run it in-process on 127.0.0.1:0; the CLI runs it until SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from motor.service.config import prepare_directory
from motor.service.grpc_server import service_name
from motor.service.metrics_http import ServiceTelemetry
from motor.service.tasks import cancel_and_wait
from motor.v1 import controller_pb2, node_manager_pb2, node_manager_pb2_grpc, types_pb2
from node_manager.config import NodeManagerConfig
from node_manager.controller_epoch import ControllerEpoch
from node_manager.controller_link import ControllerLink
from node_manager.engine import atomic_write
from node_manager.engine_tls import EngineTlsCopy
from node_manager.manager import NodeManager
from node_manager.process_identity import StateDirLock, process_identity
from node_manager.service import NodeManagerServicer

logger = logging.getLogger(__name__)


class NodeManagerServer:
    def __init__(self, config: NodeManagerConfig):
        # A state directory of the wrong shape is a configuration error naming the path, before
        # anything is created in it.
        prepare_directory(
            "state_dir",
            config.state_dir,
            subdirectories=("engines",),
            files=("node_manager.port", "node_manager.lock", "node_manager.id"),
        )
        self.config = config
        self.manager = NodeManager(config)
        # Engines get a copy of the TLS files this process uses: a bad node file never reaches them.
        self.engine_tls = (
            EngineTlsCopy(config.state_dir, config.tls_cert, config.tls_key, config.tls_ca)
            if config.tls_enabled
            else None
        )
        self._engine_tls_task: asyncio.Task | None = None
        self.lock = StateDirLock(config.state_dir)
        self.process = types_pb2.NodeManagerProcess()  # filled in by start(), once the state dir is ours
        self.telemetry = ServiceTelemetry(self.manager.metrics.registry)
        self.epoch = ControllerEpoch()  # shared: commands are checked, controller replies raise it
        # Its engines serve on --host with these TLS settings: refused here, not by each engine.
        config.check_listen(f"{config.host}:*", "host")
        self.server = config.server(config.listen, metrics=self.telemetry.grpc)
        self.server.add(
            node_manager_pb2_grpc.add_NodeManagerServiceServicer_to_server,
            NodeManagerServicer(self.manager, self.process, self.epoch),
            service_name(node_manager_pb2, "NodeManagerService"),
        )
        self.link: ControllerLink | None = None
        self._link_task: asyncio.Task | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return self.config.advertise_address or f"{self.config.host}:{self.port}"

    def node_info(self) -> controller_pb2.NodeInfo:
        start, end = self.config.port_range_bounds
        return controller_pb2.NodeInfo(
            node_id=self.config.node_id,
            address=self.address,
            host=self.config.host,
            accelerator_ids=self.config.accelerators,
            accelerator_type=self.config.accelerator_type,
            port_range_start=start,
            port_range_end=end,
            process=self.process,
            model_roots=self.config.model_roots,
        )

    async def start(self) -> int:
        os.makedirs(self.config.state_dir, exist_ok=True)
        self.lock.acquire()
        self.process.CopyFrom(process_identity(self.config.state_dir, time.time()))
        if self.engine_tls is not None:
            self.engine_tls.refresh()
            self._engine_tls_task = asyncio.get_running_loop().create_task(
                self.engine_tls.follow(), name="engine TLS copy"
            )
        await self.manager.start()
        # An engine launched from this state directory whose record is gone or unreadable (a crash
        # mid-write, a careless edit) is supervised by no one and holds accelerators this node
        # manager would offer again: stop it before serving.
        strays = await self.manager.stop_leftovers(self.process.state_dir_id)
        if strays:
            logger.warning(
                "stopped %d engine(s) launched from %s that no readable record describes", strays, self.config.state_dir
            )
        self.port = await self.server.start()
        atomic_write(os.path.join(self.config.state_dir, "node_manager.port"), f"{self.port}\n")
        logger.info(
            "node manager %s serving motor.v1.NodeManagerService on port %d (advertised as %s)",
            self.config.node_id,
            self.port,
            self.address,
        )
        await self.telemetry.serve(self.config.metrics_host, self.config.metrics_port)
        if self.config.controller:
            self.link = ControllerLink(
                self.manager,
                self.config.controller,
                self.node_info(),
                self.config.heartbeat_interval,
                tls=self.config.client_tls(),
                epoch=self.epoch,
                max_interval=self.config.max_heartbeat_interval,
            )
            self._link_task = asyncio.get_running_loop().create_task(self.link.run())
        else:
            logger.info("no --controller: running standalone (StartEngine through gRPC)")
        return self.port

    @property
    def link_task(self) -> asyncio.Task | None:
        """The controller link's task; it ends only with RegistrationRefused (or when cancelled)."""
        return self._link_task

    async def stop(self) -> None:
        """Stop serving; engines keep running (a restarted node manager re-adopts them)."""
        for task in (self._link_task, self._engine_tls_task):
            if task is not None:
                await cancel_and_wait(task, owner="node manager")
        await self.server.stop(grace=1.0)
        await self.telemetry.close()
        await self.manager.close()
        self.lock.release()
