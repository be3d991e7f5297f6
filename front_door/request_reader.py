"""A client's HTTP/1.1 requests read whole off its connection (httptools, llhttp's parser): their
heads bounded, however slowly sent, their bodies bounded by the largest the door takes, an offered
upgrade declined; what cannot be read is refused once the requests before it are answered. The
client connection (front_door/relay.py) serves what is read, one request at a time."""

from __future__ import annotations

import asyncio
import time
from collections import deque

import httptools

from front_door.bodies import TOO_LARGE
from front_door.messages import Request, body_head, routed_target

MAX_PIPELINED = 16  # requests a client may send ahead of its answers before it is read no more
HEADERS_TOO_LARGE = "The request's headers are larger than the front door takes."
MAX_HEAD = 64 * 1024  # a request's line and headers (nginx takes 32 KiB, aiohttp 8 KiB a line)


class RequestReader(asyncio.Protocol):
    """Requests read off one client connection into `waiting`; `_next` serves them, `_refuse`
    answers one that cannot be read (both the serving side's)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.waiting: deque[Request] = deque()
        self.current: Request | None = None
        self.closing = False
        self.refusal: bytes | None = None  # the answer to a request that cannot be read, once those before it are
        self.continue_owed = False  # `100 Continue`, once the requests before it are answered
        self.since = time.monotonic()  # when it last had its answer, or its request last moved
        self.body_after_upgrade: bytes | None = None  # the head to read an upgrade offer's body with
        self.resuming = False  # reading that body: the request's own line and headers are kept
        self.peer: str | None = None  # the client's address, read at its first request
        self._reset()

    @property
    def max_body(self) -> int:
        raise NotImplementedError

    def _next(self) -> None:
        raise NotImplementedError

    def _refuse(self, status: int, message: str) -> None:
        raise NotImplementedError

    def _screen(self) -> bool:
        """Whether the request whose head was just read is refused on it, before its body."""
        raise NotImplementedError

    def _peer(self) -> str:
        """The client's address, read at its first request."""
        if self.peer is None:
            peer = self.transport.get_extra_info("peername") if self.transport is not None else None
            self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer or "")
        return self.peer

    def _reset(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.size = 0
        self.in_head = False  # between a request's first byte and the end of its headers
        self.head_read = 0  # bytes read while in its head (a head still unended after a read)
        self.head_size = 0  # its line and headers as parsed

    def data_received(self, data: bytes) -> None:
        read = len(data)
        while data and self.refusal is None:
            try:
                self.parser.feed_data(data)
                data = b""
            except httptools.HttpParserUpgrade as exc:
                # An offered upgrade (`Upgrade: h2c`, a websocket) is declined by answering in
                # HTTP/1.1 (RFC 9110 7.8). llhttp takes what follows the headers for the new
                # protocol: a body the request announced is read on as its body, what follows it
                # as the next request.
                self.parser = httptools.HttpRequestParser(self)
                data = data[exc.args[0] :] if exc.args and isinstance(exc.args[0], int) else b""
                if self.body_after_upgrade is not None:
                    data, self.body_after_upgrade = self.body_after_upgrade + data, None
                    self.resuming = True
            except httptools.HttpParserError as exc:
                if not self.closing:
                    self._refuse(400, f"Malformed HTTP request: {exc}")
                return
        if self.in_head:  # a request line and headers still coming: bounded, however slowly sent
            self.head_read += read
            if self.head_read > MAX_HEAD:
                self._refuse(431, HEADERS_TOO_LARGE)

    # httptools' callbacks
    def on_message_begin(self) -> None:
        if self.resuming:
            return
        self._reset()
        self.in_head = True
        self.since = time.monotonic()  # its head must come whole within the idle timeout

    def on_url(self, url: bytes) -> None:
        if self.resuming:
            return
        self.url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.resuming or not self.in_head:  # a chunked body's trailers: dropped (the door sends a length)
            return
        self.headers.append((name, value))
        self._count_head(len(name) + len(value))

    def _count_head(self, size: int) -> None:
        self.head_size += size
        if self.head_size > MAX_HEAD:
            self._refuse(431, HEADERS_TOO_LARGE)
            raise httptools.HttpParserError("headers too large")

    def on_headers_complete(self) -> None:
        self.in_head = False
        if self.resuming:  # the stand-in head of an upgrade offer's body: the real one was read
            self.resuming = False
            return
        if self._screen():
            return  # (its body is not read: on_body drops it)
        for name, value in self.headers:
            lower = name.lower()
            if lower == b"content-length" and value.strip().isdigit() and int(value) > self.max_body:
                self._refuse(413, TOO_LARGE)
                return
            if lower == b"expect" and value.strip().lower() == b"100-continue" and not self.closing:
                self.continue_owed = True
        if self.continue_owed:
            self._next()

    def on_body(self, body: bytes) -> None:
        if self.refusal is not None:
            return
        self.since = time.monotonic()  # a body still coming, however slowly, is progress
        self.size += len(body)
        if self.size > self.max_body:
            self._refuse(413, TOO_LARGE)
            raise httptools.HttpParserError("body too large")
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.parser.should_upgrade() and self._declined_upgrade_body():
            return  # its body follows: read on with the request (data_received)
        self.continue_owed = False  # the body came without it
        if self.closing or self.refusal is not None:
            return
        target, path = routed_target(self.url)
        version = self.parser.get_http_version()
        request = Request(
            method=self.parser.get_method().decode(),
            target=target,
            path=path,
            headers=self.headers,
            body=b"".join(self.body),
            keep_alive=self.parser.should_keep_alive(),
            http_10=version == "1.0",
            peer=self._peer(),
        )
        self._reset()
        self.waiting.append(request)
        if len(self.waiting) > MAX_PIPELINED:
            self.transport.pause_reading()
        if self.current is None:
            self._next()

    def _declined_upgrade_body(self) -> bool:
        """The head to read a declined upgrade offer's body with, if it has one."""
        method, version = self.parser.get_method(), self.parser.get_http_version().encode()
        self.body_after_upgrade = body_head(method, version, self.headers, self.parser.should_keep_alive())
        return self.body_after_upgrade is not None
