"""`engine_server`: one engine's inference plane (--port) and gRPC management plane (--mgmt-port).

Exit codes: 0 after SIGTERM/SIGINT (drained and shut down), 2 for a bad command line or
user_config (the message names the field), 1 when the engine fails to start or dies. With
--termination-message-path the cause of the exit is also written there (motor.contract.termination).
The management plane answers first (INIT, "checking the configuration") while the engine's
arguments are checked (vLLM: seconds to import it and read the model's config).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Literal

from pydantic import ConfigDict, Field

# Set before anything imports prometheus_client (it picks its storage at import time).
from engine_server.prometheus_dir import ensure_private_multiproc_dir, remove_private_multiproc_dir
from motor.processes import CPUS_ENV
from motor.security.security_config import SECURITY_FLAGS, SecuritySettings
from motor.service.cli_config import Flag, load_settings, settings_parser
from motor.service.config import AbsoluteCommand
from motor.service.logs import LOG_FORMATS, LOG_LEVELS, LogFormat, LogLevel

logger = logging.getLogger("engine_server")

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
DEATH_ENGINE_SHUTDOWN_TIMEOUT = 0.5  # the whole failure exit must stay under a second


@dataclass(frozen=True)
class Exit:
    """How and why the process ends (the termination message)."""

    code: int
    cause: str  # motor.contract.termination: stopped, config_error, start_failed, engine_died
    message: str


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not within 1-65535")
    return port


def _rank(value: str) -> int:
    try:
        rank = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a rank number") from None
    if rank < 0:
        raise argparse.ArgumentTypeError(f"{rank} is negative")
    return rank


class EngineServerArgs(SecuritySettings):
    """The engine server's settings (flags only: the user_config file is --config-path)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # "nan" fails every bound: say what is wrong

    dp_rank: int = Field(ge=0)
    instance_id: str
    role: Literal["prefill", "decode", "union"]
    host: str
    port: int = Field(ge=1, le=65535)
    mgmt_port: int = Field(ge=1, le=65535)
    master_dp_ip: str
    config_path: str
    kv_port: int | None = Field(None, ge=1, le=65535)
    dp_rpc_port: int | None = Field(None, ge=1, le=65535)
    kv_events_port: int | None = Field(None, ge=1, le=65535)
    log_dir: str = "./engine_server_log/"
    log_level: LogLevel = "INFO"
    log_format: LogFormat = "text"
    termination_message_path: str | None = None
    # The node whose manager may Drain, Sleep and WakeUp this engine under TLS (it passes its id).
    owner_node: str | None = None
    # Replaces engine_args.launcher of an sglang engine (the node manager's --sglang-launcher).
    sglang_launcher: AbsoluteCommand | None = None


REQUIRED = {"required": True}
FLAGS = {
    "dp_rank": Flag("data-parallel rank within the instance", options={"type": _rank, **REQUIRED}),
    "instance_id": Flag("instance this engine belongs to, e.g. prefill-0", options=REQUIRED),
    "role": Flag("prefill, decode or union", options={"choices": ["prefill", "decode", "union"], **REQUIRED}),
    "host": Flag("address both planes bind to", options=REQUIRED),
    "port": Flag("inference plane (OpenAI-compatible HTTP)", options={"type": _port, **REQUIRED}),
    "mgmt_port": Flag("management plane (gRPC)", options={"type": _port, **REQUIRED}),
    "master_dp_ip": Flag("host of data-parallel rank 0", options=REQUIRED),
    "config_path": Flag("user_config JSON", options=REQUIRED),
    "kv_port": Flag("KV-transfer port (single-container mode)", options={"type": _port}),
    "dp_rpc_port": Flag("data-parallel RPC port (single-container mode)", options={"type": _port}),
    "kv_events_port": Flag("publish the engine's KV cache events (ZMQ) on this port", options={"type": _port}),
    "log_dir": Flag("rotated log files go here"),
    "log_level": Flag("DEBUG, INFO, WARNING, ERROR or CRITICAL", options={"type": str.upper, "choices": LOG_LEVELS}),
    "termination_message_path": Flag("write the cause of the exit here (one JSON line) just before exiting"),
    "log_format": Flag(
        "text, or json: one JSON object per line with this engine's ids",
        options={"type": str.lower, "choices": LOG_FORMATS},
    ),
    "owner_node": Flag("node id whose node manager (spiffe://<trust domain>/node/<id>) may Drain, Sleep and WakeUp it"),
    "sglang_launcher": Flag(
        "SGLang launcher command (split like a shell, an absolute path first); replaces engine_args.launcher",
        default_text="engine_args.launcher",
    ),
    **SECURITY_FLAGS,
}


def build_parser() -> argparse.ArgumentParser:
    return settings_parser(
        "engine_server",
        "Wrap one inference engine: its OpenAI HTTP API on --port, motor.v1.EngineService on --mgmt-port.",
        EngineServerArgs,
        FLAGS,
        config_file=False,
    )


def _check_args(args: EngineServerArgs, parser: argparse.ArgumentParser) -> None:
    from motor.contract.names import check_instance_id
    from motor.errors import InvalidArgument

    try:
        check_instance_id(args.instance_id, "--instance-id")
    except InvalidArgument as exc:
        parser.error(str(exc))
    ports = {
        "--port": args.port,
        "--mgmt-port": args.mgmt_port,
        "--kv-port": args.kv_port,
        "--dp-rpc-port": args.dp_rpc_port,
        "--kv-events-port": args.kv_events_port,
    }
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if port is None:
            continue
        if port in seen:
            parser.error(f"{flag} {port} is the same port as {seen[port]}")
        seen[port] = flag


async def serve(args: EngineServerArgs, section_name: str, section) -> Exit:
    from engine_server import service
    from engine_server.descendants import CLEAN_EXIT_GRACE_S, end_descendants
    from engine_server.engines import engine_class
    from engine_server.engines.base import EngineOptions
    from engine_server.kv_events_args import with_kv_events
    from engine_server.metrics import process_metrics
    from engine_server.served_model import served_model_health
    from engine_server.server import EngineServer
    from motor.contract.termination import CONFIG_ERROR, ENGINE_DIED, PORT_TAKEN, START_FAILED, STOPPED
    from motor.errors import ConfigError
    from motor.service.grpc_server import MotorServer
    from motor.service.signals import stop_event

    stop = stop_event()  # first: a stop signal while it sets up is a stop too
    if args.kv_events_port:
        port, rank = args.kv_events_port, args.dp_rank
        section.engine_args = with_kv_events(section.engine_type, section.engine_args, port, rank, args.host)
    options = EngineOptions(
        role=args.role,
        instance_id=args.instance_id,
        dp_rank=args.dp_rank,
        host=args.host,
        port=args.port,
        master_dp_ip=args.master_dp_ip,
        kv_port=args.kv_port,
        dp_rpc_port=args.dp_rpc_port,
        engine_args=section.engine_args,
    )
    if args.sglang_launcher and section.engine_type == "sglang":
        options.engine_args = {**options.engine_args, "launcher": shlex.split(args.sglang_launcher)}
    engine_cls = engine_class(section.engine_type)
    engine = engine_cls(options)
    metrics = process_metrics()
    health = served_model_health(options, section)  # up only while it serves the deployment's model
    core = EngineServer(options, section, engine, metrics=metrics, health_client=health)
    if health is not None:
        health.report_to(core.machine)
    bind = f"{args.host}:{args.mgmt_port}"
    legacy_tls = section.mgmt_tls_config.server_files()
    if legacy_tls is not None and not args.tls_enabled:
        # A standalone engine server with TLS files in its own user_config: encrypted, no identities.
        grpc_server = MotorServer(
            bind, tls=legacy_tls, reflection=args.reflection, metrics=metrics.grpc, setting="--mgmt-port"
        )
    else:
        grpc_server = args.server(
            bind, local_node=args.owner_node, setting="--host", metrics=metrics.grpc, port_setting="--mgmt-port"
        )
    metrics.loop_lag.start()
    service.register(grpc_server, core)
    try:
        await grpc_server.start()  # first, so that the node manager sees INIT while the engine loads
    except ConfigError as exc:  # the port taken: exit 2 still, but not a refusal of the spec
        logger.error("%s", exc)
        return Exit(EXIT_CONFIG, PORT_TAKEN, str(exc))

    try:
        if engine_cls.slow_check_args:  # deferred by load_section
            field = f"{section_name}.engine_args"
            section.engine_args = options.engine_args = await core.check_config(
                lambda: engine_cls.check_args(section.engine_args, field)
            )
    except ConfigError as exc:
        logger.error("invalid configuration: %s", exc)
        await grpc_server.stop(0)
        return Exit(EXIT_CONFIG, CONFIG_ERROR, str(exc))
    if stop.is_set():
        await grpc_server.stop(0)
        return Exit(EXIT_OK, STOPPED, f"{stop.signal_name} before the engine started")
    try:
        await core.start()
    except Exception as exc:
        logger.error(
            "the %s engine failed to start: %s", section.engine_type, exc, exc_info=not isinstance(exc, RuntimeError)
        )
        await core.close(engine_timeout=DEATH_ENGINE_SHUTDOWN_TIMEOUT)
        await end_descendants(grace=0, groups=engine.process_groups())
        await grpc_server.stop(0)
        return Exit(EXIT_FAILED, START_FAILED, f"the {section.engine_type} engine failed to start: {exc}")
    stopping = asyncio.ensure_future(stop.wait())
    dying = asyncio.ensure_future(core.died.wait())
    await asyncio.wait([stopping, dying], return_when=asyncio.FIRST_COMPLETED)
    if core.died.is_set():
        logger.error("exiting: the engine died (%s)", core.death_reason)
        stopping.cancel()
        # Watchers have the ABNORMAL message queued; closing ends their streams after it.
        await core.close(engine_timeout=DEATH_ENGINE_SHUTDOWN_TIMEOUT)
        await end_descendants(
            grace=0, groups=engine.process_groups()
        )  # the engine is dead: what is left of it goes now
        await grpc_server.stop(0.2)
        return Exit(EXIT_FAILED, ENGINE_DIED, f"the engine died: {core.death_reason}")
    dying.cancel()
    logger.info("%s: draining (up to %gs), then shutting down", stop.signal_name, section.drain_timeout)
    drained, left = await core.shutdown()
    await end_descendants(grace=CLEAN_EXIT_GRACE_S, groups=engine.process_groups())
    await grpc_server.stop(1.0)
    logger.info("shut down cleanly")
    how = "drained" if drained else f"drain_timeout ({section.drain_timeout:g}s) passed with {left} requests in flight"
    return Exit(EXIT_OK, STOPPED, f"{stop.signal_name}: {how}, shut down cleanly")


def bind_to_own_cores() -> None:
    """Bind this process to the CPU cores its node manager gave it (`MOTOR_ENGINE_CPUS`, on a `cpu`
    node), before any thread starts: every later thread and child process inherits the binding.
    Without it, importing torch (MKL counting the cores) moves the process onto every core of the
    host in turn, and on a core where another engine's worker spins it can stall for minutes.
    ValueError names a bad value."""
    value = os.environ.get(CPUS_ENV, "").strip()
    if not value:
        return
    try:
        cores = {int(core) for core in value.split(",")}
        os.sched_setaffinity(0, cores)
    except (ValueError, OSError) as exc:
        raise ValueError(
            f"{CPUS_ENV}={value!r}: expected this host's CPU core numbers separated by commas "
            f"(this process may run on cores {sorted(os.sched_getaffinity(0))}): {exc}"
        ) from None


def main(argv: list[str] | None = None) -> None:
    from motor.errors import ConfigError

    parser = build_parser()
    try:
        args = load_settings(EngineServerArgs, parser, argv)
    except ConfigError as exc:  # argparse has checked each flag: only a rule it cannot express
        parser.error(str(exc))
    _check_args(args, parser)
    try:
        bind_to_own_cores()
    except ValueError as exc:
        parser.error(str(exc))
    ensure_private_multiproc_dir()

    from engine_server.config import apply_usage_stats, load_section
    from motor.contract.names import engine_id
    from motor.contract.termination import CONFIG_ERROR, STOPPED
    from motor.service.logs import setup_logging

    engine = {
        "service": "engine_server",
        "instance_id": args.instance_id,
        "engine_id": engine_id(args.instance_id, args.dp_rank),
    }
    log_path = setup_logging(
        args.log_level,
        args.log_dir,
        f"engine_server_{args.instance_id}_rank{args.dp_rank}.log",
        log_format=args.log_format,
        fields=engine,
    )
    logger.info("engine_server %s rank %d (%s), log file %s", args.instance_id, args.dp_rank, args.role, log_path)
    try:
        # A slow engine_args check (vLLM) runs in serve(), once the management plane answers.
        section_name, section = load_section(args.config_path, args.role, defer_slow_checks=True)
        apply_usage_stats(section)  # before any engine starts: its children inherit it
        logger.info("using %s (engine_type %s)", section_name, section.engine_type)
        result = asyncio.run(serve(args, section_name, section))
    except ConfigError as exc:  # e.g. a bad user_config, the management port taken, a TLS file unreadable
        logger.error("invalid configuration: %s", exc)
        result = Exit(EXIT_CONFIG, CONFIG_ERROR, str(exc))
    except KeyboardInterrupt:
        result = Exit(EXIT_OK, STOPPED, "interrupted")
    _exit(args, result)


def _exit(args: EngineServerArgs, result: Exit) -> None:
    from motor.contract.termination import write_termination_message

    if args.termination_message_path:
        write_termination_message(args.termination_message_path, result.code, result.cause, result.message)
    code = result.code
    if code != EXIT_OK:
        # Engine threads or children must not hold a failing process open (or turn it into exit 0).
        remove_private_multiproc_dir()
        logging.shutdown()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
