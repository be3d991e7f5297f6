"""One bounded fan-out of messages to stream subscribers (WatchEvents, WatchEngines, WatchProbes).

Each subscriber has its own queue of at most `limit` messages. A subscriber that does not keep
up is cut, never silently starved and never allowed to hold memory: its queued messages are
dropped and its stream ends with RESOURCE_EXHAUSTED "subscriber too slow: more than N messages
queued; reconnect" (a reconnecting client gets a fresh snapshot). `close()` ends every stream
normally (the server is shutting down).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Generic, TypeVar

from motor.errors import ResourceExhausted

logger = logging.getLogger(__name__)

T = TypeVar("T")

_END = object()  # the stream ends normally
_CUT = object()  # the subscriber was too slow


class Subscription(Generic[T]):
    """One subscriber's stream: iterate it with `async for`; `close()` unsubscribes."""

    def __init__(self, fanout: FanOut[T], capacity: int):
        self._fanout = fanout
        # One slot more than the capacity: room for the end marker even when full.
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=capacity + 1)
        self._capacity = capacity
        self.cut = False

    def _offer(self, item: object) -> bool:
        """Queue `item`; False (and the subscriber cut) when the queue is full."""
        if self._queue.qsize() >= self._capacity:
            self._end(_CUT)
            return False
        self._queue.put_nowait(item)
        return True

    def _end(self, marker: object) -> None:
        if marker is _CUT:
            self.cut = True
            while not self._queue.empty():  # drop what is queued: the client re-snapshots anyway
                self._queue.get_nowait()
        self._queue.put_nowait(marker)

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)  # stays ended
            raise StopAsyncIteration
        if item is _CUT:
            self._queue.put_nowait(_CUT)
            raise ResourceExhausted(
                f"{self._fanout.name}: subscriber too slow: more than {self._fanout.limit} messages queued; reconnect"
            )
        return item

    def close(self) -> None:
        self._fanout._subscribers.discard(self)


class FanOut(Generic[T]):
    """Publish each message to every subscriber's bounded queue (see the module docstring)."""

    def __init__(self, name: str, limit: int):
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.name = name
        self.limit = limit
        self.closed = False
        self._subscribers: set[Subscription[T]] = set()

    def __len__(self) -> int:
        return len(self._subscribers)

    def subscribe(self, first: Iterable[T] = ()) -> Subscription[T]:
        """A new stream starting with `first` (e.g. a snapshot), then every published message.

        Subscribe before taking the snapshot so that no message falls between the two."""
        first = [] if self.closed else list(first)
        # The first messages do not count against the limit.
        subscription: Subscription[T] = Subscription(self, self.limit + len(first))
        for item in first:
            subscription._offer(item)
        if self.closed:
            subscription._end(_END)
        else:
            self._subscribers.add(subscription)
        return subscription

    def publish(self, item: T) -> None:
        for subscription in list(self._subscribers):
            if not subscription._offer(item):
                self._subscribers.discard(subscription)
                logger.warning("%s: cut a subscriber that fell more than %d messages behind", self.name, self.limit)

    def close(self) -> None:
        """End every stream normally; a later subscriber's stream ends at once."""
        self.closed = True
        for subscription in list(self._subscribers):
            subscription._end(_END)
        self._subscribers.clear()
