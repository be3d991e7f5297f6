"""Controller events: a bounded history and fan-out to WatchEvents subscribers."""

from __future__ import annotations

import collections
import logging

from motor import pbtime
from motor.fanout import FanOut, Subscription
from motor.names import enum_short_name
from motor.v1 import controller_pb2

logger = logging.getLogger(__name__)


class EventBus:
    def __init__(self, history: int = 500, queue_size: int = 10_000):
        self.sequence = 0
        self.recent: collections.deque[controller_pb2.Event] = collections.deque(maxlen=history)
        self.subscribers: FanOut[controller_pb2.Event] = FanOut("WatchEvents", queue_size)

    def emit(self, type_: int, message: str, node_id: str = "", instance_id: str = "", engine_id: str = "") -> controller_pb2.Event:
        self.sequence += 1
        event = controller_pb2.Event(
            sequence=self.sequence, time=pbtime.now(), type=type_, node_id=node_id,
            instance_id=instance_id, engine_id=engine_id, message=message,
        )
        self.recent.append(event)
        kind = enum_short_name(controller_pb2.EventType, type_)
        # The ids and the reason as fields too, for JSON log lines (motor.logs).
        ids = {"event": kind.lower(), "node_id": node_id, "instance_id": instance_id, "engine_id": engine_id, "reason": message}
        logger.info("event %s: %s", kind, message, extra=ids)
        self.subscribers.publish(event)
        return event

    def subscribe(self) -> Subscription[controller_pb2.Event]:
        return self.subscribers.subscribe()
