"""motor-controller: the command-line entry point."""

from __future__ import annotations

import logging
import os
import sys

from motor.cli_config import Flag, load_settings, run_service, settings_parser
from motor.deployment_file import load_deployment
from motor.grpc_server import service_name
from motor.logs import setup_logging
from motor.metrics_http import ServiceTelemetry
from motor.ports import CONTROLLER_METRICS_PORT
from motor.security_config import SECURITY_FLAGS
from motor.signals import wait_for_stop_signal
from motor.v1 import controller_pb2, controller_pb2_grpc

from controller.config import ControllerConfig
from controller.core import Controller
from controller.fleet_metrics import engine_targets
from controller.node_client import GrpcNodeClient
from controller.servicer import ControllerServicer
from controller.store import SqliteStore, StoreUnreadable
from controller.validation import validate_deployment

logger = logging.getLogger(__name__)

FLAGS = {
    "listen": Flag("host:port to serve gRPC on (port 0: a free port, written to <db dir>/controller.port)"),
    "db": Flag("SQLite file of the controller's state"),
    "deployment": Flag("deployment file applied at start-up when it differs from the stored one"),
    "heartbeat_interval": Flag("seconds between node heartbeats (told to node managers)"),
    "node_grace": Flag("seconds of silence before a node is suspect and re-checked"),
    "recheck_timeout": Flag("deadline of the direct re-check of a suspect node (s)"),
    "silent_share_alarm": Flag("share of nodes silent at once that raises the alarm (0-1)"),
    "reschedule_rate": Flag("engine moves per second allowed"),
    "metrics_port": Flag("Prometheus /metrics and /discovery/engines port (0: off)"),
    "startup_grace": Flag("after a restart, seconds to wait for nodes to report", default_text="--node-grace"),
    "stop_deadline": Flag("seconds between SIGTERM and SIGKILL when stopping an engine"),
    "log_level": Flag("DEBUG, INFO, WARNING, ERROR or CRITICAL"),
    "discard_unreadable_db": Flag("move an unreadable --db file aside and start empty (else: exit 2)", options={"action": "store_true"}),
    "log_format": Flag("text, or json: one JSON object per line"),
    "max_engines_per_deployment": Flag("engines (count x data_parallel_size) one deployment may ask for"),
    **SECURITY_FLAGS,
}


def parse_config(argv: list[str] | None) -> ControllerConfig:
    parser = settings_parser("motor-controller", "Motor controller", ControllerConfig, FLAGS)
    return load_settings(ControllerConfig, parser, argv)


def open_store(config: ControllerConfig) -> SqliteStore:
    try:
        return SqliteStore(config.db)
    except StoreUnreadable:
        if not config.discard_unreadable_db:
            raise
    aside = SqliteStore.discard(config.db)
    logger.warning("the database %s could not be read: moved to %s; starting empty (--discard-unreadable-db)", config.db, aside)
    return SqliteStore(config.db)


async def serve(config: ControllerConfig) -> None:
    store = open_store(config)
    controller = Controller(config, store, GrpcNodeClient(tls=config.client_tls()))
    await controller.start()
    if config.deployment:
        wanted = validate_deployment(load_deployment(config.deployment), config.max_engines_per_deployment)
        stored = controller.deployment
        if stored is None or wanted.SerializeToString(deterministic=True) != stored.SerializeToString(deterministic=True):
            _, revision = controller.apply_deployment(wanted)
            logger.info("applied %s at start-up (revision %d)", config.deployment, revision)
        else:
            logger.info("%s is the stored deployment already (revision %d)", config.deployment, controller.revision)
    telemetry = ServiceTelemetry(controller.metrics.registry)
    # /discovery/engines: Prometheus finds the engines' /metrics there (http_sd_configs).
    await telemetry.serve("0.0.0.0", config.metrics_port,
                          routes={"/discovery/engines": lambda: engine_targets(controller.list_instances)})
    server = config.server(config.listen, metrics=telemetry.grpc)
    server.add(controller_pb2_grpc.add_ControllerServiceServicer_to_server, ControllerServicer(controller),
               service_name(controller_pb2, "ControllerService"))
    port = await server.start()
    logger.info("controller serving on port %d (db %s)", port, config.db)
    if config.listen.rsplit(":", 1)[1] == "0":
        port_file = os.path.join(os.path.dirname(os.path.abspath(config.db)), "controller.port")
        with open(port_file, "w", encoding="utf-8") as handle:
            handle.write(f"{port}\n")
    await wait_for_stop_signal()
    logger.info("stopping")
    await server.stop(grace=1.0)
    await telemetry.close()
    await controller.stop()
    store.close()


def main(argv: list[str] | None = None) -> int:
    return run_service("motor-controller", lambda: parse_config(argv),
                       lambda c: setup_logging(c.log_level, log_format=c.log_format, fields={"service": "controller"}), serve)


if __name__ == "__main__":
    sys.exit(main())
