"""Following the controller's WatchEndpoints stream into a RouterSync, reconnecting for ever.

Each (re)connect starts with a snapshot, which the sync reconciles in full. While no controller
answers, the router keeps the workers it has (its own health checks are the second line): an
unreachable controller says nothing about the engines. Several addresses (a controller and its
standbys): the next one is tried after a failure. While a stream is open, the front door's
report (router_sync/report.py) goes to the same controller.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from motor.service.grpc_server import TlsFiles, aio_channel
from motor.service.retry import RepeatedFailure
from motor.service.tasks import cancel_and_wait
from motor.v1 import controller_pb2, controller_pb2_grpc
from router_sync.report import FrontDoorReporter
from router_sync.sync import RouterSync

logger = logging.getLogger(__name__)


async def follow(
    controllers: list[str],
    sync: RouterSync,
    tls: TlsFiles | None,
    announce: Callable[[str], None],
    sleep,
    backoff_base: float = 0.2,
    backoff_cap: float = 5.0,
    reporter: FrontDoorReporter | None = None,
) -> None:
    failure = RepeatedFailure(backoff_base, backoff_cap, jitter=True)
    turn = 0
    while True:
        address = controllers[turn % len(controllers)]
        try:
            async with aio_channel(address, tls) as channel:
                reporting = None
                try:
                    stream = controller_pb2_grpc.ControllerServiceStub(channel).WatchEndpoints(
                        controller_pb2.WatchEndpointsRequest()
                    )
                    async for message in stream:
                        if message.snapshot:
                            if failure.count:
                                announce(
                                    f"controller {address} answers again after {failure.recovered()} failed "
                                    f"try(ies); re-syncing from its list of {len(message.added)} endpoint(s)"
                                )
                            else:
                                logger.info(
                                    "following WatchEndpoints of %s: %d endpoint(s)", address, len(message.added)
                                )
                            if reporter is not None and reporting is None:
                                # Reports go to the controller whose endpoints the router follows (the leader).
                                reporting = asyncio.create_task(reporter.run(channel), name="front-door report")
                        sync.apply(message)
                    raise ConnectionError("the stream ended")
                finally:
                    if reporting is not None:
                        await cancel_and_wait(reporting, owner="front-door report")
        except (grpc.aio.AioRpcError, ConnectionError) as exc:
            why = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            if failure.failed(why):
                announce(
                    f"controller {address}: WatchEndpoints {why}; the router keeps its workers, reconnecting "
                    f"with backoff" + (f" (failure {failure.count})" if failure.count > 1 else "")
                )
            turn += 1
            await sleep(failure.delay())
