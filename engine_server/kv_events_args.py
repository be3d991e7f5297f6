"""The engine's KV-events publisher on the port its node manager gave it (`--kv-events-port`,
asked for by a controller started with --kv-events: docs/router.md, "KV routing"), as the
engine's own arguments: the simulated engine's `kv_events_port`; vLLM's `--kv-events-config`
(ZMQ, `tcp://*:PORT`). The flag wins over a port the user_config names.

vLLM adds the data-parallel rank to the endpoint's port (its ZmqEventPublisher), so an engine
server of rank r gives it PORT - r: the events come out on exactly the port the controller lists."""

from __future__ import annotations

from typing import Any

from motor.errors import ConfigError

PUBLISHING = ("sim", "vllm")


def with_kv_events(engine_type: str, engine_args: dict[str, Any], port: int, dp_rank: int) -> dict[str, Any]:
    """`engine_args` with the engine's KV events published on `port`."""
    if engine_type == "sim":
        return {**engine_args, "kv_events_port": port}
    if engine_type == "vllm":
        distributed = int(engine_args.get("data_parallel_size") or 1) > 1
        rank = int(engine_args.get("data_parallel_rank", dp_rank if distributed else 0) or 0)
        if port - rank < 1:
            raise ConfigError(f"--kv-events-port {port}: vLLM publishes on the port + the data-parallel rank ({rank})")
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port - rank}"}
        return {**engine_args, "kv_events_config": config}
    raise ConfigError(
        f"--kv-events-port: the {engine_type} engine publishes no KV events here (only {', '.join(PUBLISHING)} do); "
        f"start the controller without --kv-events"
    )
