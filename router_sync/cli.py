"""motor-router-sync: keeps one router's workers equal to the engines Motor lists (docs/router.md).

motor-router-sync --controller 127.0.0.1:50051 --router http://127.0.0.1:8081 [--by-model] [--pd]
                  [--front-door 127.0.0.1:8080] [--relist-interval 5] [--report-interval 2]
                  [--tls-ca CA --tls-cert C --tls-key K]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from motor.service.grpc_server import TlsFiles
from motor.service.logs import LOG_LEVELS
from motor.service.signals import stop_event
from router_sync.admin import RouterAdmin
from router_sync.follow import follow
from router_sync.front import FrontDoor
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
        "--front-door",
        metavar="HOST:PORT",
        help="serve the front door here (router_sync/front.py): OpenAI's /v1/models, a 404 for a model "
        "not served, a request without `model` given the one served; everything else passed to the router. "
        "Implies --by-model",
    )
    parser.add_argument(
        "--relist-interval",
        type=float,
        default=5.0,
        help="seconds between re-reads of the router's whole worker list (default 5)",
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
    if args.report_interval <= 0:
        parser.error("--report-interval must be above 0")
    if args.front_door:
        host, _, port = args.front_door.rpartition(":")
        if not host or not port.isdigit():
            parser.error(f"--front-door {args.front_door!r}: give HOST:PORT, e.g. 127.0.0.1:8080")
        args.front_door = (host.strip("[]"), int(port))
        args.by_model = True  # the front door knows models from the workers filed under them
    return args


def announce(text: str) -> None:
    """An event of the sync: one WARNING line with a fixed prefix (what an operator greps for)."""
    logger.warning("event: %s", text)


async def serve(args: argparse.Namespace) -> None:
    stop = stop_event()
    admin = RouterAdmin(args.router)
    sync = RouterSync(admin, announce, pd=args.pd, by_model=args.by_model, relist_interval=args.relist_interval)
    tls = TlsFiles(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca) if args.tls_ca else None
    controllers = [a.strip() for a in args.controller.split(",") if a.strip()]
    front = FrontDoor(args.router, sync.served, sync.knows_served) if args.front_door else None
    if front is not None:
        await front.start(*args.front_door)
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
    logger.info("keeping router %s in step with controller(s) %s", args.router, ", ".join(controllers))
    try:
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if front is not None:
            await front.close()
        await admin.close()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per admin call otherwise
    asyncio.run(serve(args))
    return 0
