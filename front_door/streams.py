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
from dataclasses import dataclass

from front_door.continuation import Plan
from front_door.messages import Request
from front_door.resend import Discard, Owner, Patience, Resend, router_failure
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
    "({passed} bytes of it had passed).{why} Retry the request."
)


@dataclass
class Hooks:
    """What the door is told of the streams it watches (front_door/policy.py: its metrics, its log)."""

    cut: Callable[[Request, str], None] = lambda request, how: None  # ended with the error event
    first: Callable[[Request], None] = lambda request: None  # its first event written (time to first token)
    continued: Callable[[Request, str], None] = lambda request, reason: None  # gone on with, and why
    resumed_after: Callable[[Request, float], None] = lambda request, gap: None  # the pause, when it goes on


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
        hooks: Hooks | None = None,
        follow: Plan | None = None,
        owner: Owner | None = None,
    ) -> None:
        self.transport = transport
        self.request = request
        self.chunked = chunked  # re-framed as chunks; else it ends when the connection does
        self.hooks = hooks or Hooks()
        self.last = b""  # the last bytes written on
        self.read: list[bytes] = []  # the body's pieces in the read being parsed
        self.pending = b""  # the start of an event whose end has not come yet
        self.passed = 0
        self.follow = follow  # the answer's tokens, to go on with it elsewhere (front_door/continuation.py)
        self.owner = owner
        self.cut_at = 0.0  # when the answer was cut, while it is gone on with
        self.patience = Patience()  # (anew at each cut)

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
        oversized = False
        if not data.endswith(b"\n\n"):  # (most reads end with an event)
            whole = events_end(data)
            oversized = len(data) - whole > MAX_PENDING
            if whole < len(data) and not oversized:
                data, self.pending = data[:whole], data[whole:]
                if not data:
                    return
        if self.follow is not None:
            if oversized:  # an event larger than the door reads: written on as it is, not followed
                self.follow = None
            else:
                data = self.follow.events(data)
                if not data:
                    return
        elif self.request is not None:  # not followed: at least a token an event, for its tenant (usage.py)
            self.request.events += data.count(b"data:")
        if not self.passed:
            self.hooks.first(self.request)
        if self.cut_at:
            self.hooks.resumed_after(self.request, time.monotonic() - self.cut_at)
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

    def end(self, broken: bool, why: str = "") -> object:
        """The router's answer ended (`broken`: its connection did, before the answer's end). Goes on
        with another engine's answer (CONTINUING) where the answer was cut and can be gone on with;
        else writes the error event if the answer was cut (saying `why` going on failed, if it
        did), then the answer's end; True if the client's answer is whole (its connection may carry
        the next request), False if that must close."""
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
                self.cut_at = self.cut_at or time.monotonic()  # (cut again before it went on: from the first)
                self.pending, self.read = b"", []
                self.patience = Patience()
                reason = follow.failed or ("broken" if broken else "ended")
                path, body = follow.next_request()
                self.hooks.continued(self.request, reason)
                self.owner.resend(self, path, body)
                return CONTINUING
            elif follow.failed:  # the engine's error event was held back: the client is sent the door's
                self.last = b""
        if not self.whole() and not (follow is not None and follow.errored):  # (an engine's own error ends it)
            self.hooks.cut(self.request, f"{'broke' if broken else 'ended'} after {self.passed} bytes")
            failed = f" Going on with it on another engine failed: {why}." if why else ""
            error = {
                "message": CUT.format(passed=self.passed, why=failed),
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
        return Discard(self, status, router_failure(status, head))

    def try_failed(self, why: str) -> None:
        """A try to go on found no engine (the router refused it, or its connection failed): tried
        again shortly until CONTINUE_WITHIN, then the stream ends with the error event."""
        owner = self.owner
        if owner is None or owner.closing:
            return
        delay = self.patience.next_delay()
        if delay is None:
            self.give_up(f"no engine took it within {self.patience.within:g}s ({why})")
            return
        follow = self.follow
        follow.continuations -= 1  # the same continuation, tried again
        again = lambda: owner.closing or owner.resend(self, *follow.next_request())  # noqa: E731
        asyncio.get_running_loop().call_later(delay, again)

    def give_up(self, why: str) -> None:
        """Going on failed: the stream ends with the error event, saying why."""
        logger.warning("stream not continued: %s", why)
        self.follow = None
        self.cut_at = 0.0
        if self.owner is not None and not self.owner.closing:
            self.owner.stream_ended(bool(self.end(broken=True, why=why)))


def watch(
    request: Request | None,
    status: int,
    head: bytes,
    owner: Owner,
    hooks: Hooks,
    resend_limit: int = 0,
) -> Stream | Resend | None:
    """What writes `request`'s answer on, which began with `head` (the router's bytes up to here:
    its status line, headers and maybe the body's first bytes): a `Stream` for a streamed
    completion (its head written to `owner`, the client's connection), a `Resend` for one the
    router got no engine to answer (at most `resend_limit` times); None to pass it as it came."""
    if request is None or request.method != "POST" or request.path not in WATCHED_PATHS:
        return None
    if router_failure(status, head) and resend_limit:  # nothing written yet: asked again

        def again(status: int, head: bytes) -> object:
            return watch(request, status, head, owner, hooks)

        return Resend(owner, resend_limit, status, again)
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
    return Stream(owner.transport, request, chunked, hooks, follow=follow, owner=owner)
