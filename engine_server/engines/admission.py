"""Which client inference requests an engine takes, and failing back the ones it holds.

One rule for every engine whose HTTP layer is Motor's (the simulated engine's aiohttp server,
vLLM's app behind vllm_admission's ASGI middleware):

- **draining** (SIGTERM, the Drain RPC): every new inference request, probes included, is answered
  503 with Retry-After; requests in flight finish;
- **not serving** (the stall watchdog, serving.py): the requests the engine holds that have sent
  nothing to their client yet (every non-streamed one, a stream before its first byte) are
  answered 503 at once and cancelled in the engine, and so is every new client request while it
  lasts, so that a router retries them on another engine instead of waiting for this one to be
  killed. A stream already under way is left alone: its client has bytes, a router cannot retry
  it, and it ends when the engine is killed. Probes still pass: a recovery probe brings the
  engine back.

The answer is vLLM's error shape (`{"error": {"message", "type", "param", "code"}}`). A router
(vllm-router retries 503 on another worker) or a client with retries sends the request elsewhere.

`Admission` is shared by the engine's loop(s) and the engine server's: vLLM serves on its own
loop in a thread, so holding, releasing and failing back go through a lock, and a held request's
fail-back runs on the loop that serves it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
from collections.abc import Callable

from motor.engine_key import engine_key, presented

logger = logging.getLogger(__name__)

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
NOT_SERVING_PREFIX = "engine not serving: "


def is_inference_request(method: str, path: str) -> bool:
    return method == "POST" and path.startswith(INFERENCE_PREFIXES)


def needs_key(method: str, path: str) -> bool:
    """Whether a request must carry the engines' key, when Motor gave one (motor/engine_key.py): the
    OpenAI surface and inference; not /health and /metrics, which routers and Prometheus read."""
    return path.startswith(("/v1/", "/v2/")) or is_inference_request(method, path)


def not_serving_message(reason: str) -> str:
    return f"{NOT_SERVING_PREFIX}{reason}"


def unavailable_body(message: str) -> bytes:
    """The 503's body, in vLLM's error format."""
    return json.dumps(
        {"error": {"message": message, "type": "ServiceUnavailableError", "param": None, "code": 503}}
    ).encode()


UNAVAILABLE_HEADERS = {"Content-Type": "application/json", "Retry-After": str(RETRY_AFTER_S)}


class HeldRequest:
    """One client inference request the engine holds, until it sends its first byte or ends.
    `fail_back(message)` is called on `loop` at most once, only while nothing was sent."""

    def __init__(
        self, admission: Admission, key: int, loop: asyncio.AbstractEventLoop, fail_back: Callable[[str], None]
    ):
        self._admission, self._key, self.loop, self._fail_back = admission, key, loop, fail_back
        self.sending = False  # its first byte is going out: too late to fail it back
        self.failed_back = False

    def start_sending(self) -> bool:
        """Called on its loop before the first byte goes to the client; False when the request
        was failed back meanwhile (then nothing of the engine's answer may be sent)."""
        if self.failed_back:
            return False
        self.sending = True
        self._admission._release(self._key)
        return True

    def release(self) -> None:
        self._admission._release(self._key)

    def _run_fail_back(self, message: str) -> None:
        # On its loop: whatever was decided on another thread, sending may have begun since.
        if self.sending or self.failed_back:
            return
        self.failed_back = True
        self._admission._release(self._key)
        self._fail_back(message)


async def failed_back_first(work: asyncio.Future, held: HeldRequest, failed_back: asyncio.Future) -> bool:
    """Wait for a held request's work or its fail-back, whichever comes first. True when it was
    failed back: the work is cancelled (the engine aborts the request) and the caller answers 503
    with `failed_back.result()`. False when the work ended first: its place is released."""
    try:
        await asyncio.wait({work, failed_back}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the client went away
        work.cancel()
        held.release()
        raise
    if not failed_back.done():
        held.release()
        return False
    work.cancel()
    return True


class Admission:
    """Whether new inference requests are taken, and the client requests held that have sent nothing yet."""

    def __init__(self) -> None:
        self.key = engine_key()  # the engines' key (motor/engine_key.py): None takes every caller
        self.draining = False
        self.not_serving = ""  # the stall watchdog's reason while it holds the engine out of the routers
        self._held: dict[int, HeldRequest] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()

    def close(self) -> None:
        """A drain starts: no new inference request from now on (probes included)."""
        self.draining = True

    def unkeyed(self, method: str, path: str, authorizations: list) -> bool:
        """Whether this request is refused 401: none of its Authorization headers carries the engines'
        key. (vllm-router sends an adapter's worker a Basic header of its own before the key's.)"""
        if self.key is None or not needs_key(method, path):
            return False
        return not any(presented(header, self.key) for header in authorizations)

    def refusal(self, probe: bool) -> str | None:
        """The 503's message for a new inference request, or None to take it."""
        if self.draining:
            return DRAINING_MESSAGE
        if self.not_serving and not probe:
            return not_serving_message(self.not_serving)
        return None

    def hold(self, fail_back: Callable[[str], None]) -> HeldRequest:
        """Register a client request now served on the running loop; `fail_back(message)` will
        answer it 503 and cancel its work there."""
        with self._lock:
            key = next(self._keys)
            held = self._held[key] = HeldRequest(self, key, asyncio.get_running_loop(), fail_back)
        return held

    def _release(self, key: int) -> None:
        with self._lock:
            self._held.pop(key, None)

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def stop_serving(self, reason: str) -> int:
        """The engine left the routers: refuse new client requests, fail back the held ones.
        Returns how many were failed back (each on its own loop, soon after)."""
        message = not_serving_message(reason)
        with self._lock:
            self.not_serving = reason
            held, self._held = list(self._held.values()), {}
        for request in held:
            try:
                request.loop.call_soon_threadsafe(request._run_fail_back, message)
            except RuntimeError:  # its loop is closed: the engine is going away
                pass
        if held:
            logger.warning("failing back %d request(s) that had sent nothing yet: %s", len(held), message)
        return len(held)

    def serve_again(self) -> None:
        with self._lock:
            self.not_serving = ""
