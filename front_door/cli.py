"""The front door's own process (docs/router.md): clients' published port, apart from the sync.

    motor-front-door --listen 0.0.0.0:8080 --router http://127.0.0.1:8081 \
        --table 127.0.0.1:8079 [--log-level INFO]

With `--api-keys FILE` every request needs a key of a tenant, held to the tenant's models and
limits (front_door/keys.py, front_door/tenancy.py); with `--tls-cert`/`--tls-key` clients speak
TLS. The key file and the certificate are read again when they change (checked every half second)
and on SIGHUP, which then reloads instead of stopping the door.

It serves `FrontDoor` (front_door/policy.py) on `--listen` and takes the table of what the router
can route from motor-router-sync, which PUTs it to `--table` (a private address: only the sync may
write it) after every change and every second (router_sync/publish.py). A sync that dies leaves the
last table in place, which stays true: the router's workers change only through the sync. So a
sync restarting touches no client connection; only this process's own death does, and it holds
no state a restart would miss beyond one push.

Until the first table arrives (this process just started) a request naming a model is answered
503 "starting", as before the sync knew what is served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import socket
import ssl
import sys
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest

from front_door.keys import KeyFileError, KeyRing
from front_door.kv_routing import KvRouting
from front_door.policy import MAX_BODY, STREAM_CONTINUATIONS, FrontDoor
from front_door.tls import DoorTls
from motor.service.logs import LOG_LEVELS, setup_logging
from motor.service.signals import stop_event

logger = logging.getLogger("motor-front-door")


class PushedTable:
    """The served table as the sync last pushed it (model -> parent model, None for a deployment's)."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.table: dict[str, str | None] | None = None  # None: no push yet
        self.pushed_at: float | None = None
        self.not_now: frozenset[str] = frozenset()  # Motor's models with no engine serving now
        self.take_engines = None  # KV routing's (front_door/kv_routing.py): takes the push's "engines"

    def served(self) -> dict[str, str | None]:
        return self.table or {}

    def unavailable(self) -> frozenset[str]:
        """Models Motor serves that cannot be served right now (503 with Retry-After, not 404)."""
        return self.not_now

    def known(self) -> bool:
        return self.table is not None

    def age(self) -> float:
        """Seconds since the last push (-1 before the first)."""
        return -1.0 if self.pushed_at is None else self.clock() - self.pushed_at

    def take(self, body: object) -> str | None:
        """A pushed body `{"served": {model: parent or null}, "unavailable": [model, ...]}` (the
        list optional); the reason it is refused, or None."""
        served = body.get("served") if isinstance(body, dict) else None
        not_now = body.get("unavailable", []) if isinstance(body, dict) else None
        if (
            not isinstance(served, dict)
            or not all(
                isinstance(name, str) and (parent is None or isinstance(parent, str)) for name, parent in served.items()
            )
            or not isinstance(not_now, list)
            or not all(isinstance(name, str) for name in not_now)
        ):
            return 'give {"served": {"<model>": null or "<parent model>", ...}, "unavailable": ["<model>", ...]}'
        if self.take_engines is not None and (refused := self.take_engines(body.get("engines", []))):
            return refused
        if set(not_now) != self.not_now:
            logger.info("served by Motor but no engine now: %s", ", ".join(sorted(not_now)) or "none")
        self.not_now = frozenset(not_now)
        if self.table is None:
            logger.info("first table from motor-router-sync: %s", ", ".join(sorted(served)) or "no model")
        elif served != self.table:
            logger.info("table from motor-router-sync: %s", ", ".join(sorted(served)) or "no model")
        self.table, self.pushed_at = served, self.clock()
        return None

    def app(self) -> web.Application:
        async def put(request: web.Request) -> web.Response:
            try:
                body = json.loads(await request.read())
            except ValueError:
                body = None
            refused = self.take(body)
            if refused is not None:
                return web.json_response({"error": refused}, status=400)
            return web.Response(status=204)

        async def get(request: web.Request) -> web.Response:
            body = {"served": self.table, "unavailable": sorted(self.not_now), "age_seconds": self.age()}
            return web.json_response(body)

        app = web.Application()
        app.router.add_put("/served", put)
        app.router.add_get("/served", get)
        return app


def host_port(parser: argparse.ArgumentParser, flag: str, value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"{flag} {value!r}: give HOST:PORT, e.g. 127.0.0.1:8080")
    return host.strip("[]"), int(port)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="motor-front-door", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, metavar="HOST:PORT", help="the published port clients use")
    parser.add_argument(
        "--listen-fd",
        type=int,
        metavar="FD",
        help="serve this inherited listening socket (bound to --listen) instead of binding one: whoever "
        "starts the door holds the port across its restarts, so no connection is refused meanwhile",
    )
    parser.add_argument(
        "--table-wait",
        type=float,
        default=3.0,
        metavar="SECONDS",
        help="connections wait in the backlog this long at most for the sync's first table (default 3)",
    )
    parser.add_argument("--router", required=True, help="the router's base URL, e.g. http://127.0.0.1:8081")
    parser.add_argument(
        "--table",
        required=True,
        metavar="HOST:PORT",
        help="where motor-router-sync pushes what is served (its --front-door-table); keep it private",
    )
    parser.add_argument(
        "--max-body",
        type=int,
        default=MAX_BODY,
        metavar="BYTES",
        help="the largest request body taken, a compressed one counted unpacked (default: the router's 256 MiB)",
    )
    parser.add_argument(
        "--first-byte-timeout",
        type=float,
        default=1800.0,
        metavar="SECONDS",
        help="the router's answer must begin within this, else 504 (default 1800, the router's request timeout; "
        "a completion that does not stream begins its answer when it is done)",
    )
    parser.add_argument(
        "--stream-continuations",
        type=int,
        default=STREAM_CONTINUATIONS,
        metavar="N",
        help="a streamed completion cut by its engine's death is gone on with on another engine, token for token, "
        f"this many times at most (default {STREAM_CONTINUATIONS}; 0: never, a cut stream ends with an error event)",
    )
    parser.add_argument(
        "--kv-routing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="choose each completion's engine by its KV cache (the engines' KV events) and send it there "
        "straight, the router taking it when that engine does not (docs/router.md)",
    )
    parser.add_argument(
        "--api-keys",
        metavar="PATH",
        help="the API key file (YAML), or a directory of such files (a mounted secret): every request needs a key "
        "of a tenant, held to its models and limits (docs/security.md); without it the door is open",
    )
    parser.add_argument("--tls-cert", metavar="FILE", help="clients speak TLS: the door's certificate (PEM, its chain)")
    parser.add_argument("--tls-key", metavar="FILE", help="the certificate's private key (PEM)")
    parser.add_argument(
        "--tls-client-ca", metavar="FILE", help="clients must present a certificate this CA signed (mutual TLS)"
    )
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    args = parser.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        parser.error("--tls-client-ca needs --tls-cert and --tls-key")
    if args.stream_continuations < 0:
        parser.error(f"--stream-continuations {args.stream_continuations}: give 0 (never) or more")
    args.listen = host_port(parser, "--listen", args.listen)
    args.table = host_port(parser, "--table", args.table)
    if not args.router.startswith(("http://", "https://")):
        parser.error(f"--router {args.router!r}: give the router's URL, e.g. http://127.0.0.1:8081")
    return args


def listen_on(host: str, port: int) -> socket.socket:
    """A socket listening on host:port now: asyncio's server listens only when it starts accepting,
    and a client connecting before that (the table not known yet) would be refused, not queued."""
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    return socket.create_server((host, port), family=family, backlog=1024)


async def follow_files(keys: KeyRing | None, tls: DoorTls | None, every: float = 0.5) -> None:
    """The key file and the certificate read again when they change: a revoked key is refused
    within `every` seconds and the time a reload takes (read on a thread: the door serves on)."""
    while True:
        await asyncio.sleep(every)
        if keys is not None and keys.changed():
            await keys.reload_aside()
        if tls is not None:
            tls.check()


def reload_on_sighup(keys: KeyRing | None, tls: DoorTls | None) -> None:
    """SIGHUP reloads the key file and the certificate (a stop signal for the door without them)."""
    reloads: set[asyncio.Future] = set()  # (a task only weakly held by the loop could be collected)

    def reload() -> None:
        logger.info("SIGHUP received: reloading the API keys and the certificate")
        if keys is not None:
            reloads.add(task := asyncio.ensure_future(keys.reload_aside()))
            task.add_done_callback(reloads.discard)
        if tls is not None:
            tls.seen = ()
            tls.check()

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)


async def serve(args: argparse.Namespace) -> None:
    stop = stop_event()
    keys = KeyRing(args.api_keys) if args.api_keys else None
    tls = DoorTls(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    table = PushedTable()
    door = FrontDoor(
        args.router,
        table.served,
        table.known,
        max_body=args.max_body,
        unavailable=table.unavailable,
        stream_continuations=args.stream_continuations,
        keys=keys,
    )
    door.relay.first_byte_timeout = args.first_byte_timeout
    kv = KvRouting.install(door, table) if args.kv_routing else None
    door.relay.ssl = tls.context if tls is not None else None
    if keys is not None or tls is not None:
        reload_on_sighup(keys, tls)
    followed = asyncio.ensure_future(follow_files(keys, tls))
    said = []
    if keys is not None:
        said.append(f"API keys from {args.api_keys}: {len(keys.keys)} key(s) of {len(keys.tenants)} tenant(s)")
    else:
        said.append("OPEN: no API keys, any client that reaches this port may use every model")
    said.append(f"TLS with {args.tls_cert}" if tls else "plain HTTP")
    if args.tls_client_ca:
        said.append("client certificates required")
    logger.info("front door: %s", "; ".join(said))
    Gauge(
        "motor_front_door_table_age_seconds",
        "Seconds since motor-router-sync last pushed what is served (-1: never; it pushes every second).",
        registry=door.metrics.registry,
    ).set_function(table.age)
    # Listening at once (before the table port: a table taken means clients' port is open),
    # accepting once the table is known (the sync pushes every second): a door started again
    # answers its first clients from the table, not with 503 "starting".
    listening = socket.socket(fileno=args.listen_fd) if args.listen_fd is not None else listen_on(*args.listen)
    await door.start(*args.listen, sock=listening, accept=False)
    table_app = table.app()

    async def metrics(request: web.Request) -> web.Response:  # (with keys, not on the published port)
        return web.Response(body=generate_latest(door.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    table_app.router.add_get("/metrics", metrics)
    table_runner = web.AppRunner(table_app, access_log=None)
    await table_runner.setup()
    await web.TCPSite(table_runner, *args.table).start()
    deadline = time.monotonic() + args.table_wait
    while not table.known() and time.monotonic() < deadline and not stop.is_set():
        await asyncio.sleep(0.02)
    await door.relay.accept_now()
    try:
        await stop.wait()
    finally:
        followed.cancel()
        await door.close()
        if kv is not None:
            await kv.close()
        await table_runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    setup_logging(args.log_level)
    try:
        asyncio.run(serve(args))
    except KeyFileError as exc:
        print(f"motor-front-door: --api-keys: {exc}", file=sys.stderr)
        return 2
    except (OSError, ssl.SSLError) as exc:
        if not args.tls_cert:
            raise
        print(f"motor-front-door: --tls-cert/--tls-key: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
