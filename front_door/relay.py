"""HTTP/1.1 pass-through from clients to the router, on asyncio's protocols and httptools (llhttp).

The front door (front_door/policy.py) decides what a request gets: an answer of its own, or the
router. This module only moves the bytes. A request is read whole (the door must see its `model`)
and sent on one pooled keep-alive connection to the router; the router's answer goes back to the
client as the router wrote it (a stream the door observes, re-chunked: `Relay.observe`), each read
written on at once and read no faster than the client takes it (back-pressure: the router's
connection stops being read while the client's buffer is full). A client that goes away closes its
request's connection to the router, which cancels the generation there.

Why not aiohttp's server and client, as the door had: they cost about 160 µs of CPU per request
against 25-30 µs here and nginx's 23 µs as a plain proxy (bench/front_door.py `--nginx`), which on a
small machine cut the rate the router alone reaches by 40-50%.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from front_door import direct
from front_door.bodies import BodyReader
from front_door.messages import (
    Answer,
    Forward,
    Passed,
    Request,
    error_answer,
    forwarded,
    routed_target,
)
from front_door.request_reader import MAX_PIPELINED, RequestReader
from front_door.resend import Resend
from front_door.router_pool import Observer, RouterConnection, RouterPool
from front_door.streams import Stream

logger = logging.getLogger(__name__)

# Methods a request of may be sent again when the router's connection closed before an answer
# (RFC 9110 9.2.2); a POST may have begun a generation, which must not run twice.
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})


class ClientConnection(RequestReader):
    """One client's connection: requests read whole (RequestReader), each answered by `decide` or
    by the router, one at a time."""

    def __init__(self, relay: Relay) -> None:
        super().__init__()
        self.relay = relay
        self.router: RouterConnection | None = None
        self.passed: Passed | None = None
        self.reused = False  # the request's router connection was a kept-alive one
        self.sent = b""  # the request as sent to the router (sent again once if that connection was stale)
        self.full = False  # its transport's buffer is full: its router connection is not read
        self.continuing: Stream | Resend | None = None  # an answer being asked of another engine
        self.direct: str | None = None  # the engine the door chose for the request (None: the router)

    @property
    def max_body(self) -> int:
        return self.relay.max_body

    # asyncio's callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.relay.connections.add(self)

    def connection_lost(self, exc) -> None:
        self.closing = True
        self.relay.connections.discard(self)
        router, self.router = self.router, None
        if router is not None:
            router.client = None
            router.transport.close()  # the router sees the client go and stops its generation
            self._done()
        elif self.continuing is not None:  # between tries to go on with its stream
            self._done()
        self.continuing = None
        self.waiting.clear()

    def pause_writing(self) -> None:
        self.full = True
        if self.router is not None:
            self.router.transport.pause_reading()

    def resume_writing(self) -> None:
        self.full = False
        if self.router is not None and not self.router.lost:
            self.router.transport.resume_reading()

    # serving, one request at a time
    def _next(self) -> None:
        while self.current is None and self.waiting and not self.closing:
            request = self.current = self.waiting.popleft()
            if len(self.waiting) == MAX_PIPELINED:
                self.transport.resume_reading()
            if self.relay.bodies.heavy(request):
                future = self.relay.bodies.off_loop(request, self.relay.max_body)
                future.add_done_callback(functools.partial(self._read_off_loop, request))
                return
            self._serve(request, self.relay.bodies.prepare(request, self.relay.max_body))
        if self.current is None and not self.waiting and not self.closing:
            if self.continue_owed and self.refusal is None:  # earlier answers written: the client may send its body
                self.continue_owed = False
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            if self.refusal is not None:
                self.closing = True
                self.transport.write(self.refusal)
                self.transport.close()

    def _read_off_loop(self, request: Request, future: asyncio.Future) -> None:
        if self.closing or future.cancelled():
            return
        try:
            refused = future.result()
        except Exception:  # noqa: BLE001 - a bug in reading one body must not stop the connection's others
            logger.exception("reading a request body")
            refused = Answer(error_answer(400, "the request body could not be read"), 400)
        self._serve(request, refused)
        self._next()

    def _serve(self, request: Request, refused: Answer | None) -> None:
        """The request, its body read: refused, answered by the door, or passed to the router."""
        if refused is not None:
            self.relay.refused(refused.status)
            self._answer(request, refused.data)
            return
        decision = self.relay.decide(request)
        if isinstance(decision, asyncio.Future):  # a choice that waits on a call (front_door/kv_tokenize.py)
            decision.add_done_callback(functools.partial(self._decided, request))
            return
        if isinstance(decision, Answer):
            self._answer(request, decision.data)
            return
        self._forward(request, decision.body, decision.engine)

    def _decided(self, request: Request, future: asyncio.Future) -> None:
        decision = None if future.cancelled() or future.exception() else future.result()
        if self.closing:  # the client went while the choice was made: what was taken is given back
            if isinstance(decision, Forward):
                self.relay.began(request)
                self.relay.ended(request, Passed())
            return
        if decision is None:
            logger.error("choosing where a request goes failed: %r; it goes to the router", future.exception())
            decision = Forward()
        if isinstance(decision, Answer):
            self._answer(request, decision.data)
        else:
            self._forward(request, decision.body, decision.engine)
        self._next()

    def _answer(self, request: Request, data: bytes) -> None:
        self.transport.write(data)
        self._finish(request)

    def _finish(self, request: Request) -> None:
        self.current = None
        self.since = time.monotonic()
        if not request.keep_alive:
            self.closing = True
            self.transport.close()

    def _forward(self, request: Request, body: bytes | None, engine: str | None = None) -> None:
        body = request.body if body is None else body
        self.direct = engine  # the engine the door chose (front_door/direct.py), None: the router
        pool = self.relay.pool if engine is None else self.relay.engine_pool(engine)
        data = forwarded(request, pool.host_header, body, pool.key_line)
        self.passed = Passed()
        self.relay.began(request)
        router = pool.take()
        if router is not None:
            self._send(router, request, data, reused=True)
        else:
            asyncio.ensure_future(self._connect_and_send(request, data, pool))

    def _send(self, router: RouterConnection, request: Request, data: bytes, reused: bool) -> None:
        self.router = router
        self.reused = reused
        self.sent = data
        if self.full:  # an earlier answer still fills the client's buffer: this one waits for it too
            router.transport.pause_reading()
        router.send(self, data, head_only=request.method == "HEAD", deadline=self.relay.first_byte_timeout)

    async def _connect_and_send(self, request: Request, data: bytes, pool: RouterPool | None = None) -> None:
        try:
            router = await (pool or self.relay.pool).open()
        except (TimeoutError, OSError) as exc:
            if self.direct is not None:
                self._to_router(request, data, f"{type(exc).__name__}: {exc}")
                return
            self._router_failed(request, exc)
            return
        if self.closing:  # the client went while the connection was made
            router.transport.close()
            self._done()
            return
        self._send(router, request, data, reused=False)

    # a stream gone on with on another engine (front_door/streams.py)
    def resend(self, stream: Stream | Resend, path: str | None = None, body: bytes | None = None) -> None:
        """Asks the router for the rest of `stream`'s answer (`path`, `body`; None: the request once
        more, as it was sent): its answer is read by `stream.resumed`, its failure told to
        `stream.try_failed`."""
        request = self.current
        if request is None or self.closing:
            return
        self.continuing = stream
        self.direct = None  # (asked again: of the router, whichever engine had it)
        if path is None or body is None:
            again, data = request, self.sent
        else:
            # (its own body, JSON as the door wrote it: the client's Content-Encoding dropped)
            again = replace(request, target=path.encode(), path=path, body=body, encoding="identity")
            data = forwarded(again, self.relay.pool.host_header, body, self.relay.pool.key_line)
        router = self.relay.pool.take()
        if router is not None:
            self._send(router, again, data, reused=True)
        else:
            asyncio.ensure_future(self._connect_and_send(again, data))

    def stream_ended(self, whole: bool, status: int = 0) -> None:
        """The answer asked again ended without its router's answer (no engine took it in time;
        `status`: the door's own answer's, if it wrote one)."""
        request, self.continuing = self.current, None
        if status and self.passed is not None:
            self.passed.status = status
        self._done()
        if whole and request is not None:
            self._finish(request)
            self._next()
        else:
            self.closing = True
            self.transport.close()

    # what the router's connection reports
    def router_began(self, status: int, head: bytes) -> Observer | None:
        if self.direct is not None and direct.refused(status) and self.current is not None:
            return direct.Fallback(self, self.current, self.direct, status)  # (read to its end, then the router)
        if self.continuing is not None and status >= 200:
            if self.passed is not None and isinstance(self.continuing, Resend):
                self.passed.status = status  # (a stream's status is its first answer's: 200)
            return self.continuing.resumed(status, head)
        if self.passed is not None and status >= 200:
            self.passed.status = status
            self.relay.answered(self.current)
            return self.relay.observe(self.current, status, head, self)
        return None

    def router_finished(self, router: RouterConnection) -> None:
        self.router = None
        self.continuing = None
        request = self.current
        self._done()
        if request is not None:
            self._finish(request)
            self._next()

    def router_lost(self, router: RouterConnection) -> None:
        self.router = None
        request = self.current
        if request is None:
            return
        if self.continuing is not None and not router.answered:
            self.continuing.try_failed("the router's connection closed before answering")
            return
        if not router.answered and self.direct is not None and not router.timed_out:
            self._to_router(request, self.sent, "the engine closed the connection before answering")
            return
        if not router.answered:
            if router.timed_out:
                self._router_failed(request, TimeoutError(f"no answer within {self.relay.first_byte_timeout:g}s"))
                return
            if self.reused and request.method in IDEMPOTENT:
                # A kept-alive connection the router had closed: once more on a new one. Only a
                # request that may run twice: the router may have begun a POST (a generation).
                self.reused = False
                asyncio.ensure_future(self._connect_and_send(request, self.sent))
                return
            why = "the router closed the connection before answering"
            if self.reused:
                why += "; the request was not sent again (it may have begun): retry it"
            self._router_failed(request, ConnectionResetError(why))
            return
        # The answer had begun (one without a length, unobserved): the client sees it end as the router's did.
        self._done()
        self.closing = True
        self.transport.close()

    def _to_router(self, request: Request, data: bytes, why: str) -> None:
        """The engine the door chose did not take the request (nothing of it written): the router's."""
        engine, self.direct = self.direct, None
        self.relay.direct_failed(engine, request, why)
        self.sent = forwarded(request, self.relay.pool.host_header, data.split(b"\r\n\r\n", 1)[1])
        router = self.relay.pool.take()
        if router is not None:
            self._send(router, request, self.sent, reused=True)
        else:
            asyncio.ensure_future(self._connect_and_send(request, self.sent))

    def _router_failed(self, request: Request, exc: BaseException) -> None:
        if self.closing:
            self._done()
            return
        if self.continuing is not None:
            self.continuing.try_failed(f"no connection to the router: {exc}")
            return
        answer = self.relay.router_failed(request, exc)
        self.passed.router_failed = True
        self.passed.status = answer.status
        self._done()
        self._answer(request, answer.data)
        self._next()

    def _done(self) -> None:
        passed, self.passed = self.passed, None
        if passed is not None:
            self.relay.ended(self.current, passed)

    def expire(self, deadline: float) -> None:
        """Closed if nothing is with the router for it and it has not moved since `deadline`."""
        if self.current is None and not self.waiting and self.since < deadline and not self.closing:
            self.closing = True
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        """A request that cannot be read: answered after the requests before it, and the
        connection closed (where it ends is lost)."""
        if self.closing or self.refusal is not None:
            return
        self.relay.refused(status)
        self._refuse_with(error_answer(status, message))

    def _refuse_with(self, data: bytes) -> None:
        self.refusal = data
        self.transport.pause_reading()
        self._next()

    def _screen(self) -> bool:
        """Whether the request whose head was just read is refused on it (its body then unread)."""
        screen = self.relay.screen
        if screen is None or self.closing or self.refusal is not None:
            return False
        method, path = self.parser.get_method().decode(), routed_target(self.url)[1]
        refused = screen(method, path, self.headers, self._peer())
        if refused is None:
            return False
        self._refuse_with(refused.data)
        return True


@dataclass
class Relay:
    """The listening side: `read` reads a request's body off the loop where it is large (an answer
    of its own when it cannot), `decide` gives a request's own answer or passes it on; `began`,
    `answered` (the router's answer began) and `ended` are told of each request passed on;
    `refused`, of each the relay answered itself as unreadable (400, 413, 415, 431, 501); `observe`
    gives what writes an answer on once its head is read (front_door/streams.py), or None: as it came."""

    pool: RouterPool
    decide: Callable[[Request], Answer | Forward]
    router_failed: Callable[[Request, BaseException], Answer]
    began: Callable[[Request], None] = lambda request: None
    answered: Callable[[Request | None], None] = lambda request: None
    ended: Callable[[Request | None, Passed], None] = lambda request, passed: None
    refused: Callable[[int], None] = lambda status: None
    # told of a request the engine the door chose refused or failed (then sent to the router)
    direct_failed: Callable[[str, Request, str], None] = lambda engine, request, why: None
    read: Callable[[Request], Answer | None] = lambda request: None
    # a request's own answer decided from its head (method, path, headers, client), before its body is read
    screen: Callable[[str, str, list, str], Answer | None] | None = None
    # (given the client's connection: its transport, and `resend` to go on with a stream elsewhere)
    observe: Callable[[Request | None, int, bytes, ClientConnection], Observer | None] = lambda *answer: None
    max_body: int = 256 * 1024 * 1024
    # A client connection with nothing with the router is closed after this many idle seconds, or
    # a request's headers not whole by then (aiohttp's server and nginx keep 75 s): clients that
    # vanish, or send a byte at a time, would hold the door's sockets for ever.
    idle_timeout: float = 75.0
    # The router's answer must begin within this (its headers: a completion that does not stream
    # sends them when it is done), else 504. As generous as the router's own --request-timeout-secs.
    first_byte_timeout: float = 1800.0
    ssl: object = None  # an ssl.SSLContext: clients speak TLS (front_door/tls.py)
    connections: set[ClientConnection] = field(default_factory=set)
    server: asyncio.Server | None = None
    sweeper: asyncio.Task | None = None
    bodies: BodyReader = field(init=False)
    engine_pools: dict[str, RouterPool] = field(default_factory=dict)  # engines the door chose, by URL

    def __post_init__(self) -> None:
        self.bodies = BodyReader(self.read)

    def engine_pool(self, url: str) -> RouterPool:
        pool = self.engine_pools.get(url)
        if pool is None:
            pool = self.engine_pools[url] = RouterPool(url)
        return pool

    async def start(self, host: str, port: int, sock: socket.socket | None = None, accept: bool = True) -> None:
        """Listen on host:port, or on `sock` (a listening socket inherited from whoever holds the
        port). With `accept` False, connections wait in the backlog until `accept_now`."""
        loop = asyncio.get_running_loop()
        where = {"sock": sock} if sock is not None else {"host": host, "port": port}
        self.server = await loop.create_server(
            lambda: ClientConnection(self), **where, backlog=1024, start_serving=accept, ssl=self.ssl
        )
        self.sweeper = asyncio.ensure_future(self._sweep())

    async def accept_now(self) -> None:
        await self.server.start_serving()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.idle_timeout / 4))
            deadline = time.monotonic() - self.idle_timeout
            for connection in list(self.connections):
                connection.expire(deadline)

    async def close(self) -> None:
        if self.sweeper is not None:
            self.sweeper.cancel()
        if self.server is not None:
            self.server.close()
        for connection in list(self.connections):
            connection.transport.close()
        self.pool.close()
        for pool in self.engine_pools.values():
            pool.close()
        self.bodies.close()
        if self.server is not None:
            await self.server.wait_closed()
