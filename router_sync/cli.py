"""motor-router-sync: keeps one router's workers equal to the engines Motor lists (docs/router.md).

motor-router-sync --controller 127.0.0.1:50051 --router http://127.0.0.1:8081 [--by-model] [--pd]
                  [--front-door-table http://127.0.0.1:8079] [--relist-interval 5] [--watch-interval 0.5]
                  [--report-interval 2]
                  [--tls-ca CA --tls-cert C --tls-key K]
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from motor.service.grpc_server import TlsFiles
from motor.service.logs import LOG_LEVELS, setup_logging
from motor.service.signals import stop_event
from router_sync.admin import RouterAdmin
from router_sync.follow import follow
from router_sync.publish import TablePublisher
from router_sync.report import FrontDoorReporter
from router_sync.sync import RouterSync

logger = logging.getLogger("motor-router-sync")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="motor-router-sync", description=__doc__.splitlines()[0])
    parser.add_argument("--controller", required=True, help="controller address(es), comma-separated (HOST:PORT)")
    parser.add_argument("--router", required=True, help="the router's base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument(
        "--pd",
        action="store_true",
        help="the router runs in P/D mode (vllm-router --enable-igw "
        "--vllm-pd-disaggregation): prefill and decode engines are added with their worker type",
    )
    parser.add_argument(
        "--by-model",
        action="store_true",
        help="the router routes by model (vllm-router --enable-igw): each engine is added under its "
        "deployment's model, so a request reaches only engines of the model it names",
    )
    parser.add_argument(
        "--front-door-table",
        metavar="URL",
        help="the front door's table address (its --table, front_door/cli.py): the sync pushes there what "
        "the router can route, after every change and every second. Implies --by-model",
    )
    # The front door ran in the sync's process once; it is its own process now (a sync that dies
    # must not take client connections with it).
    parser.add_argument("--front-door", help=argparse.SUPPRESS)
    parser.add_argument(
        "--relist-interval",
        type=float,
        default=5.0,
        help="seconds between re-reads of the router's whole worker list (default 5)",
    )
    parser.add_argument(
        "--watch-interval",
        type=float,
        default=0.5,
        help="seconds between checks that the router still holds its workers (a restarted router is "
        "empty and is given its whole list at once; a router back after failing is re-synced at once) "
        "(default 0.5)",
    )
    parser.add_argument(
        "--report-interval",
        type=float,
        default=2.0,
        help="longest time between two reports to the controller of the workers the router holds "
        "(ReportFrontDoor; also sent after each change); silent for 3 of these, the front door is stale "
        "and rollouts count no engine available through it (default 2)",
    )
    parser.add_argument("--tls-ca", help="CA of the controller's certificate: connect with mutual TLS")
    parser.add_argument(
        "--tls-cert",
        help="this sync's certificate (identity router-sync: may only read endpoints and report its router's workers)",
    )
    parser.add_argument("--tls-key", help="key of --tls-cert")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    args = parser.parse_args(argv)
    if not args.router.startswith(("http://", "https://")):
        parser.error(f"--router {args.router!r}: give a URL starting with http:// or https://")
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_cert and not args.tls_ca):
        parser.error("--tls-cert and --tls-key go together, and need --tls-ca")
    if args.relist_interval <= 0:
        parser.error("--relist-interval must be above 0")
    if args.watch_interval <= 0:
        parser.error("--watch-interval must be above 0")
    if args.report_interval <= 0:
        parser.error("--report-interval must be above 0")
    if args.front_door:
        parser.error(
            "--front-door: the front door runs in its own process now (motor-front-door --listen "
            f"{args.front_door} --router ROUTER_URL --table HOST:PORT); give this sync --front-door-table "
            "http://HOST:PORT, the door's --table"
        )
    if args.front_door_table:
        if not args.front_door_table.startswith(("http://", "https://")):
            parser.error(f"--front-door-table {args.front_door_table!r}: give a URL, e.g. http://127.0.0.1:8079")
        args.by_model = True  # the front door knows models from the workers filed under them
    return args


def announce(text: str) -> None:
    """An event of the sync: one WARNING line with a fixed prefix (what an operator greps for)."""
    logger.warning("event: %s", text)


async def serve(args: argparse.Namespace) -> None:
    stop = stop_event()
    admin = RouterAdmin(args.router)
    sync = RouterSync(
        admin,
        announce,
        pd=args.pd,
        by_model=args.by_model,
        relist_interval=args.relist_interval,
        watch_interval=args.watch_interval,
    )
    tls = TlsFiles(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca) if args.tls_ca else None
    controllers = [a.strip() for a in args.controller.split(",") if a.strip()]
    publisher = None
    if args.front_door_table:
        publisher = TablePublisher(
            args.front_door_table, announce, unavailable=sync.unavailable, engines=sync.kv_engines
        )
    tasks = [
        asyncio.create_task(sync.run()),
        asyncio.create_task(
            follow(
                controllers,
                sync,
                tls,
                announce,
                asyncio.sleep,
                reporter=FrontDoorReporter(sync, announce, args.report_interval),
            )
        ),
    ]
    if publisher is not None:
        sync.publish = publisher.push
        tasks.append(asyncio.create_task(publisher.run(sync.known_served)))
    logger.info("keeping router %s in step with controller(s) %s", args.router, ", ".join(controllers))
    try:
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if publisher is not None:
            await publisher.close()
        await admin.close()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    setup_logging(args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per admin call otherwise
    asyncio.run(serve(args))
    return 0
