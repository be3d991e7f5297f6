"""The engine's KV-events publisher on the port its node manager gave it (`--kv-events-port`,
asked for by a controller started with --kv-events: docs/router.md, "KV routing"), as the
engine's own arguments: the simulated engine's `kv_events_port`; vLLM's `--kv-events-config`
(ZMQ, on the engine server's own --host). The flag wins over a port the user_config names.

vLLM's publisher binds only an endpoint holding `*` or `::` (else it connects, publishing to no
one), so an IPv4 host H is given as `tcp://[::ffff:H]:PORT`: ZMQ binds that on H alone (the
events of `motorctl up`'s engines stay on loopback, as their HTTP does). Any other host (a name,
0.0.0.0, IPv6) keeps `tcp://*:PORT`, every address.

vLLM adds the data-parallel rank to the endpoint's port (its ZmqEventPublisher), so an engine
server of rank r gives it PORT - r: the events come out on exactly the port the controller lists."""

from __future__ import annotations

import ipaddress
from typing import Any

from motor.errors import ConfigError

PUBLISHING = ("sim", "vllm")


def zmq_bind_host(host: str) -> str:
    """The host part of a vLLM publisher endpoint that binds `host` alone where it can (above)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return "*"
    if address.version == 4 and not address.is_unspecified:
        return f"[::ffff:{address}]"
    return "*"


def with_kv_events(
    engine_type: str, engine_args: dict[str, Any], port: int, dp_rank: int, host: str = "0.0.0.0"
) -> dict[str, Any]:
    """`engine_args` with the engine's KV events published on `port` of `host`."""
    if engine_type == "sim":
        return {**engine_args, "kv_events_port": port}
    if engine_type == "vllm":
        distributed = int(engine_args.get("data_parallel_size") or 1) > 1
        rank = int(engine_args.get("data_parallel_rank", dp_rank if distributed else 0) or 0)
        if port - rank < 1:
            raise ConfigError(f"--kv-events-port {port}: vLLM publishes on the port + the data-parallel rank ({rank})")
        endpoint = f"tcp://{zmq_bind_host(host)}:{port - rank}"
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
        return {**engine_args, "kv_events_config": config}
    raise ConfigError(
        f"--kv-events-port: the {engine_type} engine publishes no KV events here (only {', '.join(PUBLISHING)} do); "
        f"start the controller without --kv-events"
    )
