"""A streamed answer is never silently truncated (issue 56, item 3; docs/router.md).

vllm-router cannot retry a stream that has begun: when the engine serving it dies, the router ends
the client's answer where the engine's ended, with no `data: [DONE]` and no error event (its
chunked answer cut, or ended as if whole). An OpenAI client reads to that end without an
exception: a truncated answer that looks complete.

The relay (front_door/relay.py) asks `watch` about each answer the router begins. For a streamed
completion or chat completion (`POST /v1/completions`, `/v1/chat/completions`; 200,
`text/event-stream`) it returns a `Stream`, which writes the answer on in its place: the router's
head as it came, each body piece as it is read (as its own chunk of the client's chunked answer),
and, when the router's answer ends, its end. Where that answer did not end with `data: [DONE]`
(the terminator OpenAI's API, vLLM and SGLang send after every whole stream of these two
endpoints) the end is first an OpenAI error event, which OpenAI's clients raise as an `APIError`
(openai-python's `Stream` raises on an event with an `error` key), and never a `[DONE]`.

Why `[DONE]` and not the last choice's `finish_reason`: a `finish_reason` comes before the usage
event (`stream_options.include_usage`), comes once per choice with `n > 1`, and the OpenAI client
itself stops only at `[DONE]`; an answer cut after its `finish_reason` but before `[DONE]` is
still reported (its text is whole; only what followed is missing).

Other streams (the Responses and Anthropic APIs, which end with events of their own, not
`[DONE]`) and every answer that is not a stream pass byte for byte as before.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable
from typing import Protocol

from front_door.continuation import Plan
from front_door.messages import Request, error_answer
from front_door.router_pool import CONTINUING

logger = logging.getLogger(__name__)

WATCHED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
MAX_PENDING = 1024 * 1024  # an event's first part held for its end at most; longer, it is written on as it is
TAIL = 64  # the answer's last bytes searched for its last event, `data: [DONE]`
# The last event is `data: [DONE]` (SSE: the space after the colon is optional; lines end in CRLF,
# LF or CR; an event ends at a blank line), whatever whitespace follows it.
DONE = re.compile(rb"(?:^|[\r\n])data: ?\[DONE\][ \t]*(?:\r\n|\n|\r)(?:\r\n|\n|\r)\s*$")
CUT = (
    "The answer was cut: the engine serving this stream stopped before the answer ended "
    "({passed} bytes of it had passed). Retry the request."
)
CONTINUE_WITHIN = 30.0  # seconds a cut stream waits for an engine of its model to go on with it
RETRY_AFTER = (0.05, 0.1, 0.25, 0.5, 1.0)  # between tries to go on, while no engine answers


class Owner(Protocol):
    """The client connection a stream is written to (front_door/relay.py's ClientConnection)."""

    transport: asyncio.Transport
    closing: bool

    def resend(self, stream: Stream | Resend, path: str | None = None, body: bytes | None = None) -> None: ...

    def stream_ended(self, whole: bool) -> None: ...


def router_failure(status: int, head: bytes) -> bool:
    """The router's own answer that no engine answered (vllm-router: 500 `Request failed: error
    sending request ...` once its retries are spent, 503 `No available workers`), in plain text;
    an engine's errors are JSON."""
    end = head.find(b"\r\n\r\n")
    return status in (500, 502, 503, 504) and b"content-type: text/plain" in head[: max(end, 0)].lower()


class Resend:
    """A request the router got no engine to answer (`router_failure`), nothing of it written to the
    client yet: sent again (an engine being replaced comes back), every RETRY_AFTER, within
    CONTINUE_WITHIN and at most `limit` times; the first answer that is not the router's own failure
    passes as it came. Then, if none: the door's 503 with an OpenAI error body."""

    def __init__(self, owner: Owner, limit: int, status: int) -> None:
        self.owner, self.left, self.status = owner, limit, status
        self.give_up_at = time.monotonic() + CONTINUE_WITHIN
        self.tries = 0

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
        return None  # an engine's answer: passed as it came

    def try_failed(self, why: str) -> None:
        owner = self.owner
        if owner.closing:
            return
        if self.left > 0 and time.monotonic() < self.give_up_at:
            self.left -= 1
            delay = RETRY_AFTER[min(self.tries, len(RETRY_AFTER) - 1)]
            self.tries += 1
            asyncio.get_running_loop().call_later(delay, lambda: owner.closing or owner.resend(self))
            return
        logger.warning("request not answered: no engine answered it after %d tries (%s)", self.tries + 1, why)
        message = f"No engine answered the request ({why}). Retry shortly."
        owner.transport.write(error_answer(503, message))
        owner.stream_ended(True)


class Discard:
    """Reads a refused try to go on with a stream (the router's 503: no engine yet) to its end."""

    def __init__(self, stream: Stream, status: int) -> None:
        self.stream, self.status = stream, status

    def body(self, data: bytes) -> None:
        pass

    def flush(self) -> None:
        pass

    def end(self, broken: bool) -> object:
        self.stream.try_failed(f"the router answered {self.status}")
        return CONTINUING


def events_end(data: bytes) -> int:
    """Where the last whole SSE event in `data` ends (an event ends at a blank line), 0 if none."""
    end = data.rfind(b"\n\n") + 2 if b"\n\n" in data else 0
    if b"\r" in data:  # lines ended by CRLF or CR (vLLM, SGLang and the router send LF)
        end = max(end, data.rfind(b"\r\n\r\n") + 4, data.rfind(b"\r\r") + 2)
    return end


class Stream:
    """One streamed answer, written on to the client as it is read; its end written by `end`."""

    def __init__(
        self,
        transport,
        request: Request,
        chunked: bool,
        cut: Callable[[Request, str], None],
        first: Callable[[Request], None] = lambda request: None,
        follow: Plan | None = None,
        owner: Owner | None = None,
        continued: Callable[[Request, str, float], None] = lambda request, reason, gap: None,
    ) -> None:
        self.transport = transport
        self.request = request
        self.chunked = chunked  # re-framed as chunks; else it ends when the connection does
        self.cut = cut
        self.first = first  # told when the first whole event goes to the client (its time to first token)
        self.last = b""  # the last bytes written on
        self.read: list[bytes] = []  # the body's pieces in the read being parsed
        self.pending = b""  # the start of an event whose end has not come yet
        self.passed = 0
        self.follow = follow  # the answer's tokens, to go on with it elsewhere (front_door/continuation.py)
        self.owner = owner
        self.continued = continued  # told when a continuation's first event is written: why, and the gap
        self.cut_at = 0.0  # when the answer was last cut, while it is gone on with
        self.why = ""
        self.tries = 0
        self.give_up_at = 0.0

    def body(self, data: bytes) -> None:
        self.read.append(data)  # (a read of several chunks is written on as one, at `flush`)

    def flush(self) -> None:
        """What the last read brought, written on up to its last whole event: an event's first part
        waits for the rest (a few bytes, until the next read), so that a cut never leaves half an
        event before the error's."""
        if not self.read:
            return
        data = self.read[0] if len(self.read) == 1 else b"".join(self.read)
        self.read.clear()
        if self.pending:
            data, self.pending = self.pending + data, b""
        if not data.endswith(b"\n\n"):  # (most reads end with an event)
            whole = events_end(data)
            if whole < len(data) and len(data) - whole <= MAX_PENDING:
                data, self.pending = data[:whole], data[whole:]
                if not data:
                    return
        if self.follow is not None:
            if self.pending:  # an event larger than the door reads: written on as it is, not followed
                self.follow = None
            else:
                data = self.follow.events(data)
                if not data:
                    return
        if not self.passed:
            self.first(self.request)
        if self.cut_at:
            self.continued(self.request, self.why, time.monotonic() - self.cut_at)
            self.cut_at = 0.0
        self.passed += len(data)
        self.last = data  # whole events: the last one is in it whole (unless one outgrew MAX_PENDING)
        self._write(data)

    def _write(self, data: bytes) -> None:
        self.transport.write(b"%x\r\n" % len(data) + data + b"\r\n" if self.chunked else data)

    def whole(self) -> bool:
        """The answer ended with `data: [DONE]` and nothing after it but whitespace (an event
        unended at the end is discarded, as an SSE client discards it)."""
        return not self.pending.strip() and DONE.search(self.last[-TAIL:]) is not None

    def end(self, broken: bool) -> object:
        """The router's answer ended (`broken`: its connection did, before the answer's end). Goes on
        with another engine's answer (CONTINUING) where the answer was cut and can be continued;
        else writes the error event if the answer was cut, then the answer's end; True if the
        client's answer is whole (its connection may carry the next request), False if that must
        close."""
        self.flush()
        if self.pending and not self.pending.strip():  # whitespace after the last event: passed on
            self._write(self.pending)
            self.pending = b""
        follow = self.follow
        if follow is not None and (follow.failed or not follow.done):
            if follow.finished:  # cut after its last token: the door writes what was to follow
                self.last = follow.tail()
                self._write(self.last)
            elif follow.can_continue() and self.owner is not None and not self.owner.closing:
                self.why = follow.failed or ("broken" if broken else "ended")
                self.cut_at = time.monotonic()
                self.pending, self.read = b"", []
                self.give_up_at = self.cut_at + CONTINUE_WITHIN
                self.tries = 0
                self.owner.resend(self, *follow.next_request())
                return CONTINUING
            elif follow.failed:  # the engine's error event was held back: the client is sent the door's
                self.last = b""
        if not self.whole():
            how = f"{'broke' if broken else 'ended'} after {self.passed} bytes"
            self.cut(self.request, how)
            error = {
                "message": CUT.format(passed=self.passed),
                "type": "ServiceUnavailableError",
                "param": None,
                "code": 503,
            }
            self._write(b"data: " + json.dumps({"error": error}).encode() + b"\n\n")
        if self.chunked:
            self.transport.write(b"0\r\n\r\n")
        return self.chunked

    def resumed(self, status: int, head: bytes) -> object:
        """What reads the router's answer to a try to go on: this stream, for an answer that streams."""
        end = head.find(b"\r\n\r\n")
        if status == 200 and b"text/event-stream" in head[: max(end, 0)].lower():
            return self
        return Discard(self, status)

    def try_failed(self, why: str) -> None:
        """A try to go on found no engine (the router refused it, or its connection failed): tried
        again shortly until CONTINUE_WITHIN, then the stream ends with the error event."""
        owner = self.owner
        if owner is None or owner.closing:
            return
        if time.monotonic() < self.give_up_at:
            delay = RETRY_AFTER[min(self.tries, len(RETRY_AFTER) - 1)]
            self.tries += 1
            follow = self.follow
            follow.continuations -= 1  # the same continuation, tried again
            again = lambda: owner.closing or owner.resend(self, *follow.next_request())  # noqa: E731
            asyncio.get_running_loop().call_later(delay, again)
            return
        logger.warning("stream not continued: no engine took it within %gs (%s)", CONTINUE_WITHIN, why)
        self.follow = None
        self.cut_at = 0.0
        owner.stream_ended(bool(self.end(broken=True)))


def watch(
    request: Request | None,
    status: int,
    head: bytes,
    owner: Owner,
    cut: Callable[[Request, str], None],
    first: Callable[[Request], None] = lambda request: None,
    continued: Callable[[Request, str, float], None] = lambda request, reason, gap: None,
    resend_limit: int = 0,
) -> Stream | Resend | None:
    """A `Stream` to write `request`'s answer on, which began with `head` (the router's bytes up to
    here: its status line, headers and maybe the body's first bytes), having written that answer's
    head to `owner` (the client's connection); None to pass the answer as it came."""
    if request is None or request.method != "POST" or request.path not in WATCHED_PATHS:
        return None
    if router_failure(status, head) and resend_limit:  # nothing written yet: asked again
        return Resend(owner, resend_limit, status)
    if status != 200:
        return None
    end = head.find(b"\r\n\r\n")
    if end < 0 or b"text/event-stream" not in head[:end].lower():
        return None
    fields: dict[bytes, bytes] = {}
    for line in head[:end].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        fields[name.strip().lower()] = value.strip().lower()
    if not fields.get(b"content-type", b"").startswith(b"text/event-stream") or b"content-length" in fields:
        return None  # a length: the answer is whole when it ends, there is nothing to add
    chunked = fields.get(b"transfer-encoding", b"").endswith(b"chunked")
    if not chunked and fields.get(b"transfer-encoding"):
        return None  # another coding (the router sends none): passed as it came
    owner.transport.write(head[: end + 4])
    follow = request.follow if chunked else None  # (an answer that ends with its connection cannot go on)
    return Stream(owner.transport, request, chunked, cut, first, follow=follow, owner=owner, continued=continued)
