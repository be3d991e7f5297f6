"""motor-controller: the command-line entry point."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from controller.api.controllers import Controllers, SingleController
from controller.api.servicer import ControllerServicer
from controller.config import ControllerConfig
from controller.core import Controller
from controller.engines.node_client import GrpcNodeClient
from controller.fleet.series import engine_targets
from controller.gc_tuning import TenuredCollections
from controller.ha.opening import advertised_address, open_high_availability
from controller.limits import raise_open_files_limit
from controller.startup_deployment import StartupDeployment
from controller.store.interface import StoreUnreadable
from controller.store.sqlite import SqliteStore
from motor.contract.deployment_file import load_deployment
from motor.security.security_config import SECURITY_FLAGS
from motor.service.cli_config import Flag, load_settings, run_service, settings_parser
from motor.service.grpc_server import service_name
from motor.service.logs import setup_logging
from motor.service.metrics_http import ServiceTelemetry
from motor.service.signals import stop_event
from motor.service.tasks import cancel_and_wait
from motor.v1 import controller_pb2, controller_pb2_grpc

logger = logging.getLogger(__name__)

FLAGS = {
    "listen": Flag("host:port to serve gRPC on (port 0: a free port, written to <db dir>/controller.port)"),
    "db": Flag("SQLite file of the controller's state"),
    "deployment": Flag(
        "deployment file that seeds a new store (first start, lost database); a store that knows a deployment is left "
        "alone"
    ),
    "heartbeat_interval": Flag("seconds between node heartbeats (told to node managers)"),
    "node_grace": Flag(
        "seconds of silence before a node is suspect and re-checked (scaled with the announced interval)"
    ),
    "max_heartbeats_per_second": Flag(
        "heartbeat rate budget of the whole fleet: the announced interval is at least live nodes / this (0: off)"
    ),
    "recheck_timeout": Flag("deadline of the direct re-check of a suspect node (s)"),
    "silent_share_alarm": Flag("share of nodes silent at once that raises the alarm (0-1)"),
    "reschedule_rate": Flag("engine moves per second allowed"),
    "metrics_port": Flag("Prometheus /metrics and /discovery/engines port (0: off)"),
    "metrics_host": Flag("address /metrics and /discovery/engines listen on (plaintext HTTP; 127.0.0.1: this host)"),
    "startup_grace": Flag(
        "after a restart, seconds to wait for nodes to report", default_text="the node grace; after a restart + 10 s"
    ),
    "kv_events": Flag(
        "engines publish their KV cache events (a port each), listed for a front door's --kv-routing",
        options={"action": "store_true"},
    ),
    "stop_deadline": Flag("seconds between SIGTERM and SIGKILL when stopping an engine"),
    "log_level": Flag("DEBUG, INFO, WARNING, ERROR or CRITICAL"),
    "discard_unreadable_db": Flag(
        "move an unreadable --db file aside and start empty (else: exit 2)", options={"action": "store_true"}
    ),
    "log_format": Flag("text, or json: one JSON object per line"),
    "event_loop": Flag("uvloop, or asyncio (the standard library's loop)"),
    "max_engines_per_deployment": Flag("engines (count x data_parallel_size) one deployment may ask for"),
    "max_engines_per_node": Flag(
        "engines one node may report in RegisterNode or a heartbeat (beyond: RESOURCE_EXHAUSTED)"
    ),
    **SECURITY_FLAGS,
    "store": Flag(
        "sqlite:///PATH or etcd://HOST:PORT[,HOST:PORT...][/PREFIX] (docs/ha.md)", default_text="sqlite:/// + --db"
    ),
    "advertise": Flag("HOST:PORT others reach this controller on", default_text="--listen, host name for 0.0.0.0"),
    "lease_ttl": Flag("etcd store: seconds of the leader's lease (a dead leader is replaced after it)"),
    "etcd_timeout": Flag("etcd store: deadline of each etcd call (s)"),
    "commit_timeout": Flag("etcd store: how long a change may wait for etcd before UNAVAILABLE (s)"),
    "etcd_startup_wait": Flag("etcd store: how long a starting controller retries reading etcd before it exits (s)"),
    "etcd_ca": Flag("etcd store: CA file of the members' certificates (turns TLS on)"),
    "etcd_cert": Flag("etcd store: client certificate file (etcd's --client-cert-auth)"),
    "etcd_key": Flag("etcd store: client key file"),
    "etcd_server_name": Flag(
        "etcd store, TLS, several members: the name each member's certificate is valid for",
        default_text="the first endpoint's host",
    ),
}


def parse_config(argv: list[str] | None) -> ControllerConfig:
    parser = settings_parser("motor-controller", "Motor controller", ControllerConfig, FLAGS)
    return load_settings(ControllerConfig, parser, argv)


def open_store(config: ControllerConfig) -> SqliteStore:
    path = config.sqlite_path
    try:
        return SqliteStore(path)
    except StoreUnreadable:
        if not config.discard_unreadable_db:
            raise
    aside = SqliteStore.discard(path)
    logger.warning(
        "the database %s could not be read: moved to %s; starting empty (--discard-unreadable-db)", path, aside
    )
    return SqliteStore(path)


def apply_startup_deployment(controller: Controller, config: ControllerConfig) -> None:
    """--deployment: seed a new store with the file, once the nodes had a chance to register; a
    store that knows a deployment is left alone (controller/startup_deployment.py)."""
    deployment = load_deployment(config.deployment)
    StartupDeployment(controller, config.deployment, deployment, controller.startup_grace()).begin()


async def open_controllers(config: ControllerConfig) -> Controllers:
    """This process's controller: one on SQLite, acting at once; or, with etcd, one of several,
    standing by until elected (controller/ha/)."""
    if config.uses_etcd:
        on_lead = (lambda controller: apply_startup_deployment(controller, config)) if config.deployment else None
        return await open_high_availability(config, on_lead)
    store = open_store(config)
    controller = Controller(config, store, GrpcNodeClient(tls=config.client_tls()))
    await controller.start()
    if config.deployment:
        apply_startup_deployment(controller, config)
    return SingleController(controller, store)


async def serve(config: ControllerConfig) -> None:
    stop = stop_event()  # first: a stop signal during start-up (a slow store, etcd) is a stop too
    open_files = raise_open_files_limit()  # a socket per node
    gc_policy = (
        TenuredCollections().install()
    )  # a large fleet's state: no full garbage collection walks it all (controller/gc_tuning.py)
    controllers = await open_controllers(config)
    telemetry = ServiceTelemetry(controllers.metrics_registry(), lambda: controllers.controller.fleet_series.render())
    gc_policy.export(telemetry.registry)
    # A deployment change holds the old and the new instances at once: a complete walk waits for its end.
    gc_policy.busy = lambda: controllers.controller is not None and controllers.controller.changes.busy
    # /discovery/engines: Prometheus finds the engines' /metrics there (http_sd_configs).
    await telemetry.serve(
        config.metrics_host,
        config.metrics_port,
        routes={"/discovery/engines": lambda: engine_targets(controllers.controller.state)},
    )
    server = config.server(config.listen, metrics=telemetry.grpc, gate=controllers.gate())
    server.add(
        controller_pb2_grpc.add_ControllerServiceServicer_to_server,
        ControllerServicer(controllers),
        service_name(controller_pb2, "ControllerService"),
    )
    port = await server.start()
    logger.info(
        "controller serving on port %d (store %s); open-file limit %d, a file per node connection "
        "(a larger fleet needs more: systemd LimitNOFILE=, docker --ulimit nofile=)",
        port,
        config.store or config.db,
        open_files,
    )
    if config.listen.rsplit(":", 1)[1] == "0":
        port_file = os.path.join(os.path.dirname(os.path.abspath(config.db)), "controller.port")
        with open(port_file, "w", encoding="utf-8") as handle:
            handle.write(f"{port}\n")
    controllers.campaign(advertised_address(config, port))
    collecting = asyncio.create_task(gc_policy.pace(), name="garbage collection")
    await stop.wait()
    logger.info("stopping")
    await controllers.resign()  # with etcd: a standby leads at once, and nothing acts once the port refuses
    await server.stop(grace=1.0)
    await telemetry.close()
    await controllers.stop()
    await cancel_and_wait(collecting, owner="controller")


def main(argv: list[str] | None = None) -> int:
    return run_service(
        "motor-controller",
        lambda: parse_config(argv),
        lambda c: setup_logging(c.log_level, log_format=c.log_format, fields={"service": "controller"}),
        serve,
        event_loop=lambda c: c.event_loop,
    )


if __name__ == "__main__":
    sys.exit(main())
