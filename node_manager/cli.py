"""`motor-node-manager`: one per host; launches and supervises engine servers.

Flags override the optional YAML file (--config), whose keys are the flag names with '_'
(motor/service/cli_config.py). Configuration errors name the field and exit with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from motor.errors import MotorError
from motor.security.security_config import SECURITY_FLAGS
from motor.service.cli_config import Flag, load_settings, run_service, settings_parser
from motor.service.logs import setup_logging
from motor.service.signals import stop_event
from node_manager.config import NodeManagerConfig
from node_manager.server import NodeManagerServer

logger = logging.getLogger(__name__)


FLAGS = {
    "node_id": Flag("unique name of this node, e.g. node-a"),
    "listen": Flag("HOST:PORT of the gRPC server (port 0: any free port)"),
    "advertise_address": Flag("HOST:PORT the controller dials", default_text="--host with the listen port"),
    "controller": Flag(
        "HOST:PORT of the controller, or several comma-separated (HA: the leader is followed); "
        "without it the node manager runs standalone"
    ),
    "host": Flag("address engines bind and advertise"),
    "accelerators": Flag("accelerators of this host, e.g. 0,1,2,3"),
    "accelerator_type": Flag(
        "nvidia, ascend, cpu (CPU cores: vLLM CPU engines bound to theirs), sim, auto (this host's GPUs "
        "from CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES or NVML, else its CPU cores; all of them unless "
        "--accelerators names some), or gpu (as auto, but no GPU found is an error)"
    ),
    "port_range": Flag("ports engines may be given, START-END"),
    "port_lock_dir": Flag("directory shared by the node managers of this host: a lock per port handed out"),
    "state_dir": Flag("engine records and configs"),
    "log_dir": Flag("node manager and engine logs", default_text="<state-dir>/logs"),
    "heartbeat_interval": Flag("seconds between status checks and heartbeats"),
    "max_heartbeat_interval": Flag("longest heartbeat interval followed when the controller announces a longer one"),
    "abnormal_threshold": Flag("consecutive abnormal heartbeats before a kill"),
    "startup_grace": Flag("seconds an engine may stay INIT"),
    "stop_deadline": Flag("default seconds from SIGTERM to SIGKILL"),
    "status_timeout": Flag("deadline of each GetStatus call, <= heartbeat interval"),
    "metrics_port": Flag("Prometheus /metrics port, 0 = off"),
    "metrics_host": Flag("address /metrics listens on (plaintext HTTP; 127.0.0.1: this host only)"),
    "engine_command": Flag("engine server command (split like a shell)"),
    "sglang_launcher": Flag(
        "SGLang launcher command for this node's sglang engines (split like a shell; starts with an absolute path)",
        default_text="python -m sglang.launch_server",
    ),
    "model_roots": Flag("folders engines may read models from, comma-separated"),
    "log_level": Flag("DEBUG, INFO, WARNING, ERROR or CRITICAL"),
    "log_format": Flag("text, or json: one JSON object per line (its engines too)"),
    **SECURITY_FLAGS,
}


def parser() -> argparse.ArgumentParser:
    return settings_parser("motor-node-manager", __doc__.splitlines()[0], NodeManagerConfig, FLAGS)


def load_config(argv: list[str] | None = None) -> NodeManagerConfig:
    return load_settings(NodeManagerConfig, parser(), argv)


async def serve(config: NodeManagerConfig) -> None:
    """Until SIGTERM/SIGINT, or until the controller refuses this node for good (raised as a
    ConfigError after stopping: exit 2 with the controller's reason)."""
    stop = stop_event()  # first: a stop signal during start-up is a stop too
    server = NodeManagerServer(config)
    await server.start()
    signalled = asyncio.ensure_future(stop.wait())
    link = server.link_task
    await asyncio.wait([signalled, *([link] if link else [])], return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    refused = link.exception() if link is not None and link.done() and not link.cancelled() else None
    if link is not None and link.cancelled() and not stop.is_set():
        # Nothing but a signal may end the link quietly: a node manager that stopped heartbeating
        # while it runs would have its node declared lost and its engines started twice.
        refused = MotorError(
            "the link to the controller ended unexpectedly (cancelled); exiting so that the "
            "supervisor restarts this node manager (engines keep running and are re-adopted)"
        )
    if refused is None:
        logger.info("shutting down (engines keep running; a restarted node manager re-adopts them)")
    await server.stop()
    if refused is not None:
        raise refused


def main(argv: list[str] | None = None) -> int:
    return run_service(
        "motor-node-manager",
        lambda: load_config(argv),
        lambda c: setup_logging(
            c.log_level,
            c.logs_dir,
            "node_manager.log",
            log_format=c.log_format,
            fields={"service": "node_manager", "node_id": c.node_id},
        ),
        serve,
    )


if __name__ == "__main__":
    sys.exit(main())
