"""The router of `motorctl up`: one vllm-router on loopback, its motor-router-sync and the front door (docs/router.md).

The router starts with no workers; the sync adds every engine Motor lists and keeps the list
true. Bound to 127.0.0.1, like the rest of a local cluster: its admin API (add/remove workers)
is reachable only from this machine. vllm-router 0.1.17's --api-key does not guard that API
(measured: an add without the key succeeds), so binding is the protection (docs/router.md).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import urllib.error
import urllib.request

from motor.engine_key import ENGINE_KEY_ENV

ROUTER_PORT = 8080
# vllm-router renames its process with setproctitle, which by default writes over the environment
# too, and with it the run tag that `motorctl down` and the guardian find processes by:
# SPT_NOENV keeps the environment.
ROUTER_ENV = {"SPT_NOENV": "1"}
# The engines' key (motor/engine_key.py) reaches them through the router two ways, measured with
# vllm-router 0.1.17: a regular request carries the Authorization the front door sent (passed on
# as it came); in the prefill/decode flow both legs carry `Bearer $OPENAI_API_KEY` of the
# router's own environment instead (empty when unset). Its --api-key and a worker's api_key are
# never sent to workers.
ROUTER_KEY_ENV = "OPENAI_API_KEY"


def router_env(engine_env: dict[str, str]) -> dict[str, str]:
    """The router's environment, given the engines' key's (motorctl/door_access.py engine_env)."""
    key = engine_env.get(ENGINE_KEY_ENV)
    return {**ROUTER_ENV, ROUTER_KEY_ENV: key} if key else ROUTER_ENV


# The router's mode whose admin API takes a worker's model and type (vllm-router 0.1.17's
# --enable-igw), always: every engine is filed under its deployment's model (and each loaded
# adapter under its own name), so a request reaches only engines of the model it names, however
# many models the cluster serves. The front door, its own process (front_door/cli.py) fed by the
# sync, listens on the published port and gives OpenAI's /v1/models, a 404 naming the served models for
# one that is not, and the one model to a request without `model`; the router listens on a
# private port of loopback. Prefill/decode (`--router-pd`): prefill and decode engines are typed
# workers, and each request goes to a prefill engine, then to a decode engine with the prefill's
# KV handoff; the sync runs with --pd.
TYPED_WORKER_FLAGS = ["--enable-igw"]
# Each request goes to the less loaded of two workers drawn at random, load being the router's own
# count of requests it has in flight on each (vllm-router 0.1.17's power_of_two). Round robin gave
# an engine added by a scale-up only its share of new requests while the backlog queued on the
# first engine drained at that engine's leftover capacity; measured with two engines, one with 120
# requests queued: round robin sent it 20 of the next 40, power_of_two none (docs/router.md).
# A hung engine's requests stay in flight, so it soon gets no new ones either.
ROUTING_POLICY = ["--policy", "power_of_two"]
# What the router does with a request whose engine fails it (docs/router.md, "When an engine
# fails"). vllm-router 0.1.17 retries a request, on the worker its policy picks again, when its
# worker answers 408/429/500/502/503/504 or cannot be reached (a refused or reset connection, a
# SIGKILLed engine: it answers that 500 itself): this many attempts in all, 50 ms apart, then x1.5
# each.
# A worker that fails this many requests in a row gets none for the circuit's timeout (an engine
# answering 500 while its /health says 200), then one trial. The timeout is short because a false
# open (a client's request that fails the same way on every engine, retried onto each) would
# otherwise shut the only engine of a deployment for the router's default of 60 s; by then Motor
# has taken a failing engine out of the router anyway. (In the --enable-igw mode, vllm-router
# 0.1.17 gives workers added at run time its own circuit settings, 5 failures and 30 s, whatever
# these flags say: measured.)
# The request timeout is the whole request's, a stream's body included, and a timed-out request is
# retried like a failed one (measured: a 3 s completion under a 1 s timeout ran 5 times, then 500):
# it must exceed the longest legitimate generation, so it cannot tell a hung engine from a long
# answer. A hung engine's requests end when Motor kills it (the router then retries them).
FAILOVER_FLAGS = [
    "--retry-max-retries",
    "5",
    "--retry-initial-backoff-ms",
    "50",
    "--retry-backoff-multiplier",
    "1.5",
    "--retry-max-backoff-ms",
    "1000",
    "--cb-failure-threshold",
    "10",
    "--cb-timeout-duration-secs",
    "15",
    "--request-timeout-secs",
    "1800",
]


def router_binary() -> str:
    local = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    return local if os.path.exists(local) else (shutil.which("vllm-router") or "vllm-router")


def router_command(port: int, metrics_port: int) -> list[str]:
    argv = [
        router_binary(),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *ROUTING_POLICY,
        # Its Prometheus exporter is on by default, on 29000: two routers on a machine clash.
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        # An add waits for the worker's /health: Motor adds only engines that serve already.
        "--worker-startup-timeout-secs",
        "10",
        "--worker-startup-check-interval",
        "1",
        *FAILOVER_FLAGS,
        *TYPED_WORKER_FLAGS,
    ]
    return argv


def sync_command(
    controllers: list[str], router_url: str, front_door_table: str, tls: list[str], pd: bool = False
) -> list[str]:
    """The sync of `router_url`, pushing what is served to the front door's `front_door_table` (URL)."""
    return [
        sys.executable,
        "-m",
        "router_sync",
        "--controller",
        ",".join(controllers),
        "--router",
        router_url,
        "--front-door-table",
        front_door_table,
        *(["--pd"] if pd else []),
        *tls,
    ]


def door_command(
    listen: str, router_url: str, table: str, listen_fd: int | None = None, extra: list[str] | None = None
) -> list[str]:
    """The front door on `listen` (HOST:PORT) in front of `router_url`, its table taken on `table`
    (HOST:PORT, private: the sync writes it). Its own process, so that a sync that dies or restarts
    touches no client connection (docs/router.md). With `listen_fd` it serves that inherited socket
    (listening on `listen`) instead of binding its own."""
    fd = ["--listen-fd", str(listen_fd)] if listen_fd is not None else []
    return [
        *[sys.executable, "-m", "front_door.cli", "--listen", listen, *fd, "--router", router_url, "--table", table],
        *(extra or []),
    ]


def held_listener(host: str, port: int) -> socket.socket:
    """The published port's listening socket, held by `motorctl up` and inherited by each door
    process it starts: while a door that died is started again, new connections wait in its
    backlog instead of being refused (as nginx's master holds its workers' sockets)."""
    listener = socket.create_server((host, port), backlog=1024)
    listener.set_inheritable(True)
    return listener


def router_workers(url: str, timeout: float = 2.0) -> list[str] | None:
    """The router's worker URLs (through the front door too), or None when it does not answer. An
    engine with loaded adapters is one worker per name it serves (router_sync/sync.py)."""
    try:
        with urllib.request.urlopen(url + "/list_workers", timeout=timeout) as reply:
            return list(json.loads(reply.read())["urls"])
    except (OSError, ValueError, KeyError, urllib.error.HTTPError):
        return None


def door_has_table(table: str, timeout: float = 2.0) -> bool:
    """Whether the front door whose table port is `table` (HOST:PORT) has had the sync's table: it
    accepts clients from then on."""
    try:
        with urllib.request.urlopen(f"http://{table}/served", timeout=timeout) as reply:
            return json.loads(reply.read()).get("served") is not None
    except (OSError, ValueError, AttributeError, urllib.error.HTTPError):
        return False


def router_line(
    url: str, kept: str = "kept by motor-router-sync", workers_url: str | None = None, note: str = ""
) -> str:
    """The screen's line: `kept` says what keeps the workers (a sync that is down says so); the
    workers read from `workers_url` (the router's own port), else through `url`; `note`: who may
    use the door."""
    workers = router_workers(workers_url or url)
    # one engine per address: an adapter's worker is the engine's address with a user part
    engines = None if workers is None else {w.split("://", 1)[-1].rpartition("@")[2] for w in workers}
    state = "not answering" if engines is None else f"{len(engines)} worker(s)"
    line = f"Router (OpenAI API):  {url}/v1  ({state}; {kept})"
    return line + (f"\n  front door: {note}" if note else "")
