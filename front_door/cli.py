"""The front door's own process (docs/router.md): clients' published port, apart from the sync.

    motor-front-door --listen 0.0.0.0:8080 --router http://127.0.0.1:8081 \
        --table 127.0.0.1:8079 [--log-level INFO]

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
import socket
import sys
import time

from aiohttp import web
from prometheus_client import Gauge

from front_door.policy import MAX_BODY, STREAM_CONTINUATIONS, FrontDoor
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
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    args = parser.parse_args(argv)
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


async def serve(args: argparse.Namespace) -> None:
    stop = stop_event()
    table = PushedTable()
    door = FrontDoor(
        args.router,
        table.served,
        table.known,
        max_body=args.max_body,
        unavailable=table.unavailable,
        stream_continuations=args.stream_continuations,
    )
    door.relay.first_byte_timeout = args.first_byte_timeout
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
    table_runner = web.AppRunner(table.app(), access_log=None)
    await table_runner.setup()
    await web.TCPSite(table_runner, *args.table).start()
    deadline = time.monotonic() + args.table_wait
    while not table.known() and time.monotonic() < deadline and not stop.is_set():
        await asyncio.sleep(0.02)
    await door.relay.accept_now()
    try:
        await stop.wait()
    finally:
        await door.close()
        await table_runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    setup_logging(args.log_level)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
