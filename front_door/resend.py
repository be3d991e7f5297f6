"""Asking the router again: for the rest of a cut stream (front_door/streams.py's Stream goes on
with it), or for a whole request no engine answered (`Resend`). Both wait for an engine the same
way: tries RETRY_AFTER apart, within CONTINUE_WITHIN of the cut (docs/router.md, "When an engine
fails")."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Protocol

from front_door.messages import error_answer
from front_door.router_pool import CONTINUING

logger = logging.getLogger(__name__)

CONTINUE_WITHIN = 30.0  # seconds a cut stream, or a request no engine answered, waits for an engine
RETRY_AFTER = (0.05, 0.1, 0.25, 0.5, 1.0)  # between tries, while no engine answers
MAX_REFUSAL = 64 * 1024  # bytes of an engine's refusal kept, to tell the client why


class Owner(Protocol):
    """The client connection an answer is written to (front_door/relay.py's ClientConnection)."""

    transport: asyncio.Transport
    closing: bool

    def resend(self, asking: object, path: str | None = None, body: bytes | None = None) -> None: ...

    def stream_ended(self, whole: bool, status: int = 0) -> None: ...


class Going(Protocol):
    """What goes on with a cut stream (front_door/streams.py's Stream)."""

    def try_failed(self, why: str) -> None: ...

    def give_up(self, why: str) -> None: ...


def router_failure(status: int, head: bytes) -> bool:
    """The router's own answer that no engine answered (vllm-router: 500 `Request failed: error
    sending request ...` once its retries are spent, 503 `No available workers`), in plain text;
    an engine's errors are JSON."""
    end = head.find(b"\r\n\r\n")
    return status in (500, 502, 503, 504) and b"content-type: text/plain" in head[: max(end, 0)].lower()


class Patience:
    """Waiting for an engine: tries RETRY_AFTER apart, within CONTINUE_WITHIN of the first."""

    def __init__(self) -> None:
        self.within = CONTINUE_WITHIN
        self.until = time.monotonic() + self.within
        self.tries = 0

    def next_delay(self) -> float | None:
        """Seconds until the next try; None once CONTINUE_WITHIN has passed."""
        if time.monotonic() >= self.until:
            return None
        self.tries += 1
        return RETRY_AFTER[min(self.tries - 1, len(RETRY_AFTER) - 1)]


class Resend:
    """A request the router got no engine to answer (`router_failure`), nothing of it written to the
    client yet: sent again (an engine being replaced comes back), every RETRY_AFTER, within
    CONTINUE_WITHIN and at most `limit` times. The first answer that is not the router's own
    failure is read as the first would have been (`again`: a stream followed, or as it came). Then,
    if none: the door's 503 in OpenAI's error shape."""

    def __init__(self, owner: Owner, limit: int, status: int, again: Callable[[int, bytes], object]) -> None:
        self.owner, self.left, self.status, self.again = owner, limit, status, again
        self.patience = Patience()

    def body(self, data: bytes) -> None:
        pass

    def flush(self) -> None:
        pass

    def end(self, broken: bool) -> object:
        self.try_failed(f"the router answered {self.status}")
        return CONTINUING

    def resumed(self, status: int, head: bytes) -> object:
        if router_failure(status, head):
            self.status = status
            return self  # read to its end, then tried again
        return self.again(status, head)

    def try_failed(self, why: str) -> None:
        owner = self.owner
        if owner.closing:
            return
        delay = self.patience.next_delay() if self.left > 0 else None
        if delay is not None:
            self.left -= 1
            asyncio.get_running_loop().call_later(delay, lambda: owner.closing or owner.resend(self))
            return
        tries = self.patience.tries + 1
        logger.warning("request not answered: no engine answered it after %d tries (%s)", tries, why)
        owner.transport.write(error_answer(503, f"No engine answered the request ({why}). Retry shortly."))
        owner.stream_ended(True, 503)


class Discard:
    """Reads the router's refusal of a try to go on with a stream to its end: the router's own (no
    engine yet) or an engine's 5xx is tried again; an engine's 4xx (it cannot take the request, e.g.
    the prompt with the tokens sent is over its context) ends the stream, its message told."""

    def __init__(self, going: Going, status: int, router_own: bool) -> None:
        self.going, self.status, self.router_own = going, status, router_own
        self.refusal = b""

    def body(self, data: bytes) -> None:
        if len(self.refusal) < MAX_REFUSAL:
            self.refusal += data[: MAX_REFUSAL - len(self.refusal)]

    def flush(self) -> None:
        pass

    def end(self, broken: bool) -> object:
        if self.router_own or self.status >= 500:
            self.going.try_failed(f"the router answered {self.status}")
        else:
            self.going.give_up(f"an engine answered {self.status}: {refusal_message(self.refusal)}")
        return CONTINUING


def refusal_message(body: bytes) -> str:
    """An engine's error body's message (vLLM's `{"error": {"message": ...}}`), else its first bytes."""
    try:
        message = json.loads(body)["error"]["message"]
        if isinstance(message, str):
            return message[:500]
    except (ValueError, KeyError, TypeError):
        pass
    return body[:200].decode("utf-8", "replace")
