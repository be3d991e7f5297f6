"""The /metrics endpoint of the controller and the node managers, on the service's own event loop
(aiohttp), with the event-loop lag and gRPC series every service shares.

    telemetry = ServiceTelemetry(registry)          # before the gRPC server is built
    server = MotorServer(bind, metrics=telemetry.grpc)
    await telemetry.serve("0.0.0.0", 9471, routes={"/discovery/engines": engine_targets})
    ...
    await telemetry.close()

`routes` adds JSON GET endpoints beside /metrics (the controller's Prometheus service discovery).
`more` (the controller's fleet series) streams exposition text written after the registry's, in
pieces, so a large one does not hold the loop for the whole scrape; a scrape that asks for gzip
(Prometheus does) gets it compressed in a worker thread (`GzipOffLoop`).
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from motor.errors import ConfigError
from motor.service.config import is_loopback
from motor.service.grpc_metrics import GrpcServerMetrics
from motor.service.loop_lag import EventLoopLag

logger = logging.getLogger(__name__)

WRITE_BATCH = 1 << 18  # bytes of plain text per write


class ServiceTelemetry:
    def __init__(self, registry: CollectorRegistry, more: Callable[[], AsyncIterator[bytes]] | None = None):
        self.registry, self.more = registry, more
        self.grpc = GrpcServerMetrics(registry)
        self.loop_lag = EventLoopLag(registry)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def serve(self, host: str, port: int, routes: dict[str, Callable[[], Any]] | None = None) -> int:
        """Starts the loop-lag timer and, when `port` is not 0, serves /metrics. Returns the port."""
        self.loop_lag.start()
        if not port:
            return 0
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        for path, produce in (routes or {}).items():
            app.router.add_get(path, self._json(produce))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            self._runner = None
            raise ConfigError(
                f"metrics_port: cannot listen on {host}:{port} ({exc.strerror}); choose another port, or 0 to turn "
                "/metrics off"
            ) from None
        self.port = port
        logger.info("Prometheus metrics on http://%s:%d/metrics", host, port)
        if not is_loopback(f"{host}:{port}"):  # HTTP has no TLS here: say what the network can read
            logger.warning(
                "metrics_host %s: /metrics%s on port %d are plaintext HTTP, readable by anyone who reaches this "
                "host (read-only; docs/security.md); set metrics_host 127.0.0.1 to keep them on this host",
                host,
                " and " + ", ".join(routes) if routes else "",
                port,
            )
        return port

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        # ?name[]=SERIES...: only those of the registry's series (as prometheus_client's own
        # handler does), without the pieces `more` streams (the controller's fleet series).
        names = request.query.getall("name[]", [])
        if names or self.more is None:
            registry = self.registry.restricted_registry(names) if names else self.registry
            return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
        gzip = GzipOffLoop() if accepts_gzip(request.headers.get("Accept-Encoding", "")) else None
        headers = {"Content-Type": CONTENT_TYPE_LATEST}
        if gzip is not None:
            headers["Content-Encoding"] = "gzip"
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        # Pieces gathered into fewer, larger writes (or hand-overs to the compressing thread).
        batch: list[bytes] = []
        size = 0

        async def send() -> None:
            nonlocal size
            data = b"".join(batch) if gzip is None else await gzip.compress(batch.copy())
            batch.clear()
            size = 0
            if data:
                await response.write(data)

        batch.append(generate_latest(self.registry))
        async for piece in self.more():
            batch.append(piece)
            size += len(piece)
            if size >= (WRITE_BATCH if gzip is None else GzipOffLoop.BATCH):
                await send()
        await send()
        if gzip is not None:
            await response.write(await gzip.finish())
        await response.write_eof()
        return response

    @staticmethod
    def _json(produce: Callable[[], Any]):
        async def handler(request: web.Request) -> web.Response:
            return web.json_response(produce())

        return handler

    async def close(self) -> None:
        await self.loop_lag.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an Accept-Encoding header takes gzip (`gzip`, `gzip;q=0.5`, `*`; not `gzip;q=0`)."""
    for item in accept_encoding.lower().split(","):
        coding, _, params = item.partition(";")
        if coding.strip() in ("gzip", "*"):
            q = params.strip().removeprefix("q=")
            try:
                return not params.strip() or float(q) > 0
            except ValueError:
                return True
    return False


class GzipOffLoop:
    """One gzip stream, compressed in a worker thread: zlib lets go of the GIL while it compresses,
    so the loop only hands over lists of pieces (BATCH bytes at a time, not joined: no copy on the
    loop). Level 1: the fleet's text is repetitive (some 30x smaller even at zlib's fastest level;
    40 MB in about 65 ms of the worker's CPU at 10,000 nodes x 8 engines, where the default level
    takes four times as long)."""

    BATCH = 1 << 20

    def __init__(self) -> None:
        self._zlib = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)  # 16+: gzip's header and trailer

    async def compress(self, pieces: list[bytes]) -> bytes:
        """What is ready of the stream once `pieces` are added (often b"": zlib holds some back)."""
        return await asyncio.to_thread(lambda: b"".join(map(self._zlib.compress, pieces)))

    async def finish(self) -> bytes:
        """The rest of the stream, with gzip's trailer."""
        return await asyncio.to_thread(self._zlib.flush)
