"""Controller events: a bounded history and fan-out to WatchEvents subscribers."""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from google.protobuf.timestamp_pb2 import Timestamp

from motor.names import enum_short_name
from motor.v1 import controller_pb2

logger = logging.getLogger(__name__)


class EventBus:
    def __init__(self, history: int = 500, queue_size: int = 10_000):
        self.sequence = 0
        self.recent: collections.deque[controller_pb2.Event] = collections.deque(maxlen=history)
        self.subscribers: set[asyncio.Queue] = set()
        self.queue_size = queue_size

    def emit(self, type_: int, message: str, node_id: str = "", instance_id: str = "", engine_id: str = "") -> controller_pb2.Event:
        self.sequence += 1
        stamp = Timestamp()
        stamp.FromNanoseconds(time.time_ns())
        event = controller_pb2.Event(
            sequence=self.sequence, time=stamp, type=type_, node_id=node_id,
            instance_id=instance_id, engine_id=engine_id, message=message,
        )
        self.recent.append(event)
        logger.info("event %s: %s", enum_short_name(controller_pb2.EventType, type_), message)
        for queue in list(self.subscribers):
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                # A watcher that does not read is cut off rather than holding memory forever.
                self.subscribers.discard(queue)
                queue.dropped = True  # type: ignore[attr-defined]
        return event

    def subscribe(self) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.queue_size)
        self.subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self.subscribers.discard(queue)
