"""Refuse new inference requests from the start of a drain; requests in flight go on. Count
how client inference requests end (the stall watchdog's `request_outcomes`).

An ASGI middleware in front of vLLM's app: once `Admission.close()` is called (SIGTERM or the
Drain RPC), a new inference request is answered 503 with `Retry-After` and an OpenAI-style error
body, so that a client or router sends it to another engine and the drain ends as soon as the
requests already admitted are done. Everything else (`/health`, `/metrics`, `/v1/models`, ...)
keeps answering.
"""

from __future__ import annotations

import json
from typing import Any

from engine_server.engines.base import is_probe_request_id

# POST routes that start inference work in vLLM 0.32 (OpenAI, Anthropic, SageMaker, pooling).
INFERENCE_PREFIXES = (
    "/v1/",
    "/v2/",
    "/inference/",
    "/invocations",
    "/pooling",
    "/classify",
    "/score",
    "/rerank",
    "/generate",
)
RETRY_AFTER_S = 1
DRAINING_MESSAGE = "this engine is draining (stopping) and admits no new requests: send the request to another engine"


def is_inference_request(method: str, path: str) -> bool:
    return method == "POST" and path.startswith(INFERENCE_PREFIXES)


class Admission:
    """Whether new inference requests are admitted (shared by the engine and the middleware)."""

    def __init__(self) -> None:
        self.open = True

    def close(self) -> None:
        self.open = False


class RequestOutcomes:
    """Client inference requests by how they were answered: 2xx succeeded, 5xx other than 503
    (which a draining or sleeping engine answers on purpose) failed. Probes are not counted.
    Written by vLLM's loop thread, read by the engine server's: plain ints."""

    def __init__(self) -> None:
        self.succeeded = self.failed = 0

    def count(self, status: int) -> None:
        if 200 <= status < 300:
            self.succeeded += 1
        elif status >= 500 and status != 503:
            self.failed += 1


def _request_id(scope: dict) -> str:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"x-request-id":
            return value.decode("latin-1")
    return ""


class RefuseWhileDraining:
    """ASGI middleware: 503 + Retry-After for new inference requests once admission is closed;
    the status of every client inference request's answer goes to `outcomes`."""

    def __init__(self, app: Any, admission: Admission, outcomes: RequestOutcomes | None = None):
        self.app, self.admission = app, admission
        self.outcomes = outcomes if outcomes is not None else RequestOutcomes()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not is_inference_request(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        if self.admission.open:
            if is_probe_request_id(_request_id(scope)):
                await self.app(scope, receive, send)
                return

            async def counted_send(message: dict) -> None:
                if message["type"] == "http.response.start":
                    self.outcomes.count(message["status"])
                await send(message)

            await self.app(scope, receive, counted_send)
            return
        body = json.dumps(
            {
                "error": {
                    "message": DRAINING_MESSAGE,
                    "type": "ServiceUnavailableError",
                    "code": 503,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", str(RETRY_AFTER_S).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
