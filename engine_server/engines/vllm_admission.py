"""vLLM's HTTP layer of admission (admission.py): an ASGI middleware in front of vLLM's app.

- From the start of a drain (`Admission.close()`: SIGTERM or the Drain RPC) a new inference
  request is answered 503 with `Retry-After`, so that a client or router sends it to another
  engine and the drain ends as soon as the requests already admitted are done.
- While the stall watchdog holds the engine out of the routers, a client request it holds that
  has sent nothing yet is answered 503 at once and its handler cancelled (vLLM aborts the request
  in the engine core), and new client requests get the same 503. To tell "nothing sent" apart,
  the response's start is held back until its first body bytes: a stream's 200 goes out with its
  first chunk, not before.
- The status of every client inference request's answer goes to `outcomes` (the stall
  watchdog's `request_outcomes`).

Everything else (`/health`, `/metrics`, `/v1/models`, ...) passes untouched.
"""

from __future__ import annotations

import asyncio
from typing import Any

from engine_server.engines.admission import (
    RETRY_AFTER_S,
    Admission,
    failed_back_first,
    is_inference_request,
    unavailable_body,
)
from engine_server.engines.base import is_probe_request_id
from motor.engine_key import UNAUTHORIZED_BODY

# How long a failed-back request's handler may take to end once cancelled (vLLM aborts the
# request: a message to the engine core, which does not block even when the core is stopped).
CANCEL_GRACE_S = 2.0


class RequestOutcomes:
    """Client inference requests by how they were answered: 2xx succeeded, 5xx other than 503
    (which a draining, sleeping or not-serving engine answers on purpose) failed. Probes are not
    counted. Written by vLLM's loop thread, read by the engine server's: plain ints."""

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


def _headers(scope: dict, lower: bytes) -> list[bytes]:
    return [value for name, value in scope.get("headers", ()) if name.lower() == lower]


async def send_unauthorized(send: Any) -> None:
    """401 to a request without the engines' key (motor/engine_key.py)."""
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(UNAUTHORIZED_BODY)).encode())]
    await send({"type": "http.response.start", "status": 401, "headers": [*head, (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": UNAUTHORIZED_BODY})


async def send_unavailable(send: Any, message: str) -> None:
    body = unavailable_body(message)
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


class AdmissionMiddleware:
    """ASGI middleware: refusals and fail-backs of `admission`, outcomes counted in `outcomes`."""

    def __init__(self, app: Any, admission: Admission, outcomes: RequestOutcomes | None = None):
        self.app, self.admission = app, admission
        self.outcomes = outcomes if outcomes is not None else RequestOutcomes()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.admission.unkeyed(
            scope["method"], scope["path"], _headers(scope, b"authorization")
        ):
            await send_unauthorized(send)
            return
        if scope["type"] != "http" or not is_inference_request(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        probe = is_probe_request_id(_request_id(scope))
        refusal = self.admission.refusal(probe)
        if refusal is not None:
            await send_unavailable(send, refusal)
        elif probe:
            await self.app(scope, receive, send)
        else:
            await self._held(scope, receive, send)

    async def _held(self, scope: dict, receive: Any, send: Any) -> None:
        """Serve a client request that can be failed back until its first body bytes go out."""
        failed_back: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        held = self.admission.hold(lambda message: failed_back.done() or failed_back.set_result(message))
        start: dict | None = None

        async def held_send(message: dict) -> None:
            nonlocal start
            if held.failed_back:
                return  # the client has its 503: nothing of this answer goes out
            if not held.sending:
                if message["type"] == "http.response.start":
                    start = message
                    return
                if message["type"] == "http.response.body" and not message.get("body") and message.get("more_body"):
                    return  # nothing for the client yet
                if not held.start_sending():
                    return
                if start is not None:
                    self.outcomes.count(start["status"])
                    await send(start)
            await send(message)

        work = asyncio.ensure_future(self.app(scope, receive, held_send))
        if not await failed_back_first(work, held, failed_back):
            work.result()  # its exception, if any, is uvicorn's to report
            return
        await send_unavailable(send, failed_back.result())  # failed back: vLLM aborts the cancelled request
        await asyncio.wait({work}, timeout=CANCEL_GRACE_S)
        if work.done() and not work.cancelled():
            work.exception()  # an error it ended on after the fail-back: the client has its 503
