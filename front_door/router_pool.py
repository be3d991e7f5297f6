"""Keep-alive connections from the front door to the router, one request at a time each."""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Protocol
from urllib.parse import urlsplit

import httptools

from motor.engine_key import authorization_line, engine_key

logger = logging.getLogger(__name__)

MAX_IDLE = 256  # idle connections to the router kept for reuse
CONTINUING = object()  # an observer's `end` when the client's answer goes on with another request's


class Observer(Protocol):
    """Writes an answer on in the relay's place (front_door/streams.py's Stream): its body's pieces
    (`body`) as each read is parsed (`flush`), then its end; `end` says whether the client's answer
    is whole (else its connection closes)."""

    def body(self, data: bytes) -> None: ...

    def flush(self) -> None: ...

    def end(self, broken: bool) -> object: ...


class RouterClient(Protocol):
    """What a connection to the router tells the client connection it carries a request for
    (front_door/relay.py's ClientConnection)."""

    transport: asyncio.Transport

    def router_began(self, status: int, head: bytes) -> Observer | None: ...

    def router_finished(self, connection: RouterConnection) -> None: ...

    def router_lost(self, connection: RouterConnection) -> None: ...


class RouterPool:
    """Keep-alive connections to the router: an idle one is reused, else a new one is opened."""

    def __init__(self, router_url: str) -> None:
        parts = urlsplit(router_url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.https else 80)
        self.host_header = (parts.netloc or self.host).encode()
        # The engines' key (motor/engine_key.py), sent on every request: vllm-router passes a
        # request's Authorization on to the engine it picks, but sends no key of its own.
        key = engine_key()
        self.key_line = authorization_line(key)
        self.idle: list[RouterConnection] = []
        self.closed = False

    def take(self) -> RouterConnection | None:
        while self.idle:
            connection = self.idle.pop()
            if not connection.lost:
                return connection
        return None

    async def open(self) -> RouterConnection:
        loop = asyncio.get_running_loop()
        context = ssl.create_default_context() if self.https else None
        _, connection = await asyncio.wait_for(
            loop.create_connection(lambda: RouterConnection(self), self.host, self.port, ssl=context), 10
        )
        return connection

    def give_back(self, connection: RouterConnection) -> None:
        if self.closed or connection.lost or len(self.idle) >= MAX_IDLE:
            connection.transport.close()
        else:
            connection.transport.resume_reading()  # paused for a slow client as its answer ended
            self.idle.append(connection)

    def close(self) -> None:
        self.closed = True
        for connection in self.idle:
            connection.transport.close()
        self.idle.clear()


class RouterConnection(asyncio.Protocol):
    """One connection to the router, carrying one request at a time for a client connection."""

    def __init__(self, pool: RouterPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.client: RouterClient | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.head_only = False
        self.answered = False  # a byte of the answer reached the client
        self.head: bytes | None = None  # the answer's bytes until its head is read (then written), else None
        self.observer: Observer | None = None  # writes this answer on in place of `data_received`
        self.lost = False
        self.first_byte: asyncio.TimerHandle | None = None  # the deadline on the answer's first byte
        self.timed_out = False  # closed by that deadline

    def connection_made(self, transport) -> None:
        self.transport = transport

    def send(self, client: RouterClient, data: bytes, head_only: bool, deadline: float) -> None:
        """`data` sent for `client`; closed (timed_out) if no byte of an answer comes within `deadline` s."""
        self.client, self.head_only, self.answered = client, head_only, False
        self.head, self.observer = b"", None
        self.parser = httptools.HttpResponseParser(self)
        self.transport.write(data)
        self.first_byte = asyncio.get_running_loop().call_later(deadline, self._no_first_byte)

    def _no_first_byte(self) -> None:
        self.timed_out = True
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is None:  # nothing asked: the router has nothing to say on this connection
            self.transport.close()
            return
        if self.first_byte is not None:
            self.first_byte.cancel()
            self.first_byte = None
        if self.head is not None:  # held until the head is read: the client's answer may be observed
            self.head += data
        elif self.observer is None:
            client.transport.write(data)
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):  # (a 101: the door never asks for one)
            self.transport.close()  # the client's answer is cut where the router's went wrong
        if self.observer is not None:
            self.observer.flush()

    # httptools' callbacks
    def on_headers_complete(self) -> None:
        if self.client is not None:
            head, self.head = self.head, None  # (None after an interim 1xx answer: what follows passed as it came)
            self.observer = self.client.router_began(self.parser.get_status_code(), head or b"")
            if head and self.observer is None:
                self.client.transport.write(head)
            self.answered = True
        if self.head_only:
            self.on_message_complete()

    def on_body(self, body: bytes) -> None:
        if self.observer is not None:
            self.observer.body(body)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        if client is None or self.parser.get_status_code() < 200:
            self.client = client  # an interim answer (1xx): the real one follows
            return
        going_on = self.observer is not None and self.observer.end(broken=False) is CONTINUING
        keep = self.parser.should_keep_alive()
        if not going_on:  # (else the client's answer goes on with another connection's)
            client.router_finished(self)
        if keep:
            self.pool.give_back(self)
        else:
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.lost = True
        if self.first_byte is not None:
            self.first_byte.cancel()
        client, self.client = self.client, None
        ended = self.observer.end(broken=True) if client is not None and self.observer is not None else False
        if ended is CONTINUING:
            return  # the client's answer goes on with another connection's
        if ended:
            client.router_finished(self)  # the observer ended the client's answer whole
        elif client is not None:
            client.router_lost(self)
