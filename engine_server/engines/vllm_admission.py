"""Refuse new inference requests from the start of a drain; requests in flight go on.

An ASGI middleware in front of vLLM's app: once `Admission.close()` is called (SIGTERM or the
Drain RPC), a new inference request is answered 503 with `Retry-After` and an OpenAI-style error
body, so that a client or router sends it to another engine and the drain ends as soon as the
requests already admitted are done. Everything else (`/health`, `/metrics`, `/v1/models`, ...)
keeps answering.
"""

from __future__ import annotations

import json
from typing import Any

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


class RefuseWhileDraining:
    """ASGI middleware: 503 + Retry-After for new inference requests once admission is closed."""

    def __init__(self, app: Any, admission: Admission):
        self.app, self.admission = app, admission

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.admission.open or not is_inference_request(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
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
