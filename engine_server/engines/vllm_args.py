"""vLLM's arguments for the engine server: `engine_args` -> `vllm serve` flags, checked.

`engine_args` are vLLM's `vllm serve` arguments (`max_model_len: 256` is `--max-model-len 256`),
except the keys in MOTOR_KEYS, which are the engine server's own; host and port come from the
engine server's command line. Also the environment vLLM must see before it is imported.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

from engine_server.engines.base import EngineOptions
from motor.contract.vllm_request_args import MOTOR_ENGINE_ARGS, unsupported_vllm_arg
from motor.errors import ConfigError

logger = logging.getLogger(__name__)

# engine_args keys read by this backend, never passed to vLLM.
MOTOR_UTILIZATION = "motor_utilization"
MOTOR_KEYS = MOTOR_ENGINE_ARGS  # the request check (motor/contract/engine_policy.py) lets these through too
# vLLM arguments the engine server sets from its own command line.
OWNED_ARGS = {"host": "--host", "port": "--port"}


def prepare_environment() -> None:
    """Environment vLLM must see before it is imported, for use inside the engine server."""
    # gRPC does not survive fork(): vLLM must exec its engine core (spawn), never fork it.
    method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    if method and method != "spawn":
        logger.warning("VLLM_WORKER_MULTIPROC_METHOD=%s replaced by spawn: the engine server runs gRPC", method)
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    # vLLM's records go to the engine server's handlers (rotated log file) instead of its own
    # stdout handler; set VLLM_CONFIGURE_LOGGING=1 to get vLLM's format back.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")


WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def kv_side_channel_environment(options: EngineOptions, environ: Any = os.environ) -> dict[str, str]:
    """With --kv-port (single-container mode, where P/D engines share the host's ports): the
    environment that puts vLLM's NIXL connector side channel on exactly that port, and (unless
    the environment names one) on the engine's --host, which decode engines are told to reach.

    vLLM listens on VLLM_NIXL_SIDE_CHANNEL_PORT + the data-parallel rank, so the rank is taken off."""
    if options.kv_port is None:
        return {}
    engine_args = options.engine_args
    distributed = int(engine_args.get("data_parallel_size") or 1) > 1
    rank = int(engine_args.get("data_parallel_rank", options.dp_rank if distributed else 0) or 0)
    if options.kv_port - rank < 1:
        raise ConfigError(
            f"--kv-port {options.kv_port}: vLLM's NIXL side channel listens on VLLM_NIXL_SIDE_CHANNEL_PORT + the "
            f"data-parallel rank ({rank}); choose a port above the rank"
        )
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(options.kv_port - rank)}
    if options.host not in WILDCARD_HOSTS and not environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST"):
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = options.host
    return env


def import_keeping_logging(module: str) -> None:
    """Import `module`, undoing what its import does to the root logger's level and handlers.

    vLLM's app imports SageMaker's model_hosting_container_standards, whose import sets the root
    logger (and its handlers) to ERROR: every INFO record of the engine server would vanish."""
    root = logging.getLogger()
    level, handler_levels = root.level, [(h, h.level) for h in root.handlers]
    try:
        __import__(module)
    except ImportError:
        return
    finally:
        root.setLevel(level)
        for handler, handler_level in handler_levels:
            handler.setLevel(handler_level)


def _cli_value(value: Any) -> str:
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value)
    return str(value)


def engine_args_to_cli(engine_args: dict[str, Any], parser: Any, field: str = "engine_args") -> list[str]:
    """Translate the engine_args mapping into `vllm serve` flags, checking each key exists.

    Raises ConfigError naming `<field>.<key>` for an unknown key or one the engine server owns."""
    import argparse

    argv: list[str] = []
    for key, value in engine_args.items():
        if key in MOTOR_KEYS or value is None:
            continue
        if key in OWNED_ARGS:
            raise ConfigError(f"{field}.{key}: set by the engine server's command line ({OWNED_ARGS[key]}); remove it")
        flag = "--" + key.replace("_", "-")
        action = parser._option_string_actions.get(flag)
        if action is None:
            raise ConfigError(f"{field}.{key}: not a vLLM argument (no {flag} in `vllm serve --help=all`)")
        if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)):
            if not isinstance(value, bool):
                raise ConfigError(f"{field}.{key}: must be true or false (got {value!r})")
            if isinstance(action, argparse.BooleanOptionalAction):
                argv.append(flag if value else "--no-" + flag[2:])
            elif value:
                argv.append(flag)
        elif isinstance(value, (list, tuple)) and action.nargs in ("+", "*"):
            argv.append(flag)
            argv.extend(_cli_value(item) for item in value)
        else:
            argv.extend([flag, _cli_value(value)])
    return argv


def check_motor_keys(engine_args: dict[str, Any], field: str) -> None:
    for key, value in engine_args.items():
        unsupported = unsupported_vllm_arg(str(key).replace("-", "_"), value)
        if unsupported:
            raise ConfigError(f"{field}.{key}: {unsupported}")
    utilization = engine_args.get(MOTOR_UTILIZATION)
    if utilization is not None and (
        isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 <= utilization <= 100
    ):
        raise ConfigError(f"{field}.{MOTOR_UTILIZATION}: must be a number from 0 to 100 (got {utilization!r})")
    model = engine_args.get("model")
    if not model or not isinstance(model, str):
        raise ConfigError(f"{field}.model: required (a model folder or a model name vLLM can download)")
    # A path that does not exist would reach the model hub and fail with an unrelated message.
    if model.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(model)):
        raise ConfigError(f"{field}.model: no such model folder {model!r}")


def parse_engine_args(options: EngineOptions, field: str = "engine_args") -> Any:
    """engine_args + the engine server's command line -> the Namespace `vllm serve` would parse.

    Raises ConfigError naming `<field>.<key>` for anything vLLM's parser rejects."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    engine_args = dict(options.engine_args)
    check_motor_keys(engine_args, field)
    parser = make_arg_parser(FlexibleArgumentParser(prog="engine_server (vllm engine_args)"))
    argv = engine_args_to_cli(engine_args, parser, field)
    argv += ["--host", options.host, "--port", str(options.port)]
    argv += _data_parallel_args(options, engine_args)

    def error(message: str):
        # argparse names the flag (`argument --max-model-len: invalid ...`): name the key instead.
        match = re.search(r"argument (--[\w-]+)", message)
        key = "." + match.group(1)[2:].replace("-", "_") if match else ""
        raise ConfigError(f"{field}{key}: {message}")

    parser.error = error  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    try:
        validate_parsed_serve_args(args)
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"{field}: {exc}") from None
    return args


def create_vllm_config(args: Any, field: str = "engine_args") -> Any:
    """vLLM's engine configuration (reads the model's config; checks dtype, lengths, ...)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    try:
        return AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    except (ValueError, TypeError, OSError) as exc:
        # Unknown model, unsupported dtype, max_model_len too long...: vLLM's message names it.
        raise ConfigError(f"{field}: vLLM rejected the configuration: {exc}") from None


def _data_parallel_args(options: EngineOptions, engine_args: dict[str, Any]) -> list[str]:
    """One engine server per data-parallel rank (external load balancing): the rank and the
    master's address come from the engine server's command line."""
    size = engine_args.get("data_parallel_size") or 1
    if int(size) <= 1:
        return []
    argv = []
    if "data_parallel_rank" not in engine_args:
        argv += ["--data-parallel-rank", str(options.dp_rank)]
    if "data_parallel_address" not in engine_args and options.master_dp_ip:
        argv += ["--data-parallel-address", options.master_dp_ip]
    if "data_parallel_rpc_port" not in engine_args and options.dp_rpc_port:
        argv += ["--data-parallel-rpc-port", str(options.dp_rpc_port)]
    return argv
