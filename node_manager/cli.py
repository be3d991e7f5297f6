"""`motor-node-manager`: one per host; launches and supervises engine servers.

Flags override the optional YAML file (--config), whose keys are the flag names with '_'.
Configuration errors name the field and exit with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from motor.config import read_document, validate
from motor.errors import ConfigError
from motor.logs import setup_logging
from motor.signals import stop_event
from node_manager.config import NodeManagerConfig
from node_manager.server import NodeManagerServer

logger = logging.getLogger(__name__)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="motor-node-manager", description=__doc__.splitlines()[0],
                                argument_default=argparse.SUPPRESS)
    p.add_argument("--config", help="YAML file with the same keys as the flags (flags win)")
    p.add_argument("--node-id", help="unique name of this node, e.g. node-a")
    p.add_argument("--listen", help="HOST:PORT of the gRPC server (port 0: any free port) [0.0.0.0:50052]")
    p.add_argument("--advertise-address", help="HOST:PORT the controller dials [--host with the listen port]")
    p.add_argument("--controller", help="HOST:PORT of the controller; without it the node manager runs standalone")
    p.add_argument("--host", help="address engines bind and advertise [127.0.0.1]")
    p.add_argument("--accelerators", help="accelerators of this host, e.g. 0,1,2,3 [none]")
    p.add_argument("--accelerator-type", help="nvidia, ascend or sim [sim]")
    p.add_argument("--port-range", help="ports engines may be given, START-END [20000-29999]")
    p.add_argument("--state-dir", help="engine records and configs [./.state/node]")
    p.add_argument("--log-dir", help="node manager and engine logs [<state-dir>/logs]")
    p.add_argument("--heartbeat-interval", type=float, help="seconds between status checks and heartbeats [1.0]")
    p.add_argument("--abnormal-threshold", type=int, help="consecutive abnormal heartbeats before a kill [5]")
    p.add_argument("--startup-grace", type=float, help="seconds an engine may stay INIT [600]")
    p.add_argument("--stop-deadline", type=float, help="default seconds from SIGTERM to SIGKILL [10]")
    p.add_argument("--status-timeout", type=float, help="deadline of each GetStatus call, <= heartbeat interval [1.0]")
    p.add_argument("--metrics-port", type=int, help="Prometheus metrics port, 0 = off [0]")
    p.add_argument("--engine-command", help="engine server command (split like a shell) [engine_server]")
    p.add_argument("--engine-tls-cert", help="client certificate for engines that verify clients "
                   "[the engine's mgmt_tls_config.cert_file]")
    p.add_argument("--engine-tls-key", help="key of --engine-tls-cert [the engine's mgmt_tls_config.key_file]")
    p.add_argument("--engine-tls-ca", help="CA of the engines' server certificates [the engine's mgmt_tls_config.ca_file]")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR or CRITICAL [INFO]")
    return p


def load_config(argv: list[str] | None = None) -> NodeManagerConfig:
    args = vars(parser().parse_args(argv))
    data: dict = {}
    source = "command line"
    if "config" in args:
        source = f"{args['config']} + command line"
        loaded = read_document(args.pop("config"))
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{source}: expected a mapping of settings")
        data.update(loaded or {})
    data.update(args)
    if "node_id" not in data:
        raise ConfigError("node_id: required (--node-id or node_id in --config)")
    return validate(NodeManagerConfig, data, source=source)


async def serve(config: NodeManagerConfig) -> None:
    """Until SIGTERM/SIGINT, or until the controller refuses this node for good (raised as a
    ConfigError after stopping: exit 2 with the controller's reason)."""
    server = NodeManagerServer(config)
    await server.start()
    signalled = asyncio.ensure_future(stop_event().wait())
    link = server.link_task
    await asyncio.wait([signalled, *([link] if link else [])], return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    refused = link.exception() if link is not None and link.done() and not link.cancelled() else None
    if refused is None:
        logger.info("shutting down (engines keep running; a restarted node manager re-adopts them)")
    await server.stop()
    if refused is not None:
        raise refused


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ConfigError as exc:
        print(f"motor-node-manager: configuration error: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.logs_dir, "node_manager.log")
    try:
        asyncio.run(serve(config))
    except ConfigError as exc:
        logger.error("configuration error: %s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
