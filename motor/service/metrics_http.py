"""The /metrics endpoint of the controller and the node managers, on the service's own event loop
(aiohttp), with the event-loop lag and gRPC series every service shares.

    telemetry = ServiceTelemetry(registry)          # before the gRPC server is built
    server = MotorServer(bind, interceptors=[telemetry.grpc])
    await telemetry.serve("0.0.0.0", 9471, routes={"/discovery/engines": engine_targets})
    ...
    await telemetry.close()

`routes` adds JSON GET endpoints beside /metrics (the controller's Prometheus service discovery).
`more` (the controller's fleet series) streams exposition text written after the registry's, in
pieces, so a large one does not hold the loop for the whole scrape.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from motor.errors import ConfigError
from motor.service.grpc_metrics import GrpcServerMetrics
from motor.service.loop_lag import EventLoopLag

logger = logging.getLogger(__name__)


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
        return port

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        # ?name[]=SERIES...: only those of the registry's series (as prometheus_client's own
        # handler does), without the pieces `more` streams (the controller's fleet series).
        names = request.query.getall("name[]", [])
        if names or self.more is None:
            registry = self.registry.restricted_registry(names) if names else self.registry
            return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
        response = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE_LATEST})
        await response.prepare(request)
        await response.write(generate_latest(self.registry))
        async for piece in self.more():
            await response.write(piece)
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
