"""Controller events: a bounded history and fan-out to WatchEvents subscribers. A failure that
repeats is one event whose count grows (`repeat`, then `settle` when it stops), not one per try."""

from __future__ import annotations

import collections
import logging

from motor.contract import pbtime
from motor.contract.names import CONTROL_CHARACTER, enum_short_name
from motor.service.fanout import FanOut, Subscription
from motor.service.retry import worth_reporting
from motor.v1 import controller_pb2

logger = logging.getLogger(__name__)

# Repeating operations followed at once; beyond that the oldest is forgotten (its next try is a new event).
REPEATING_LIMIT = 10_000
# The longest event message kept, sent and logged: the reasons it quotes come from nodes and engines.
EVENT_MESSAGE_CHARS = 2000


def one_line(message: str) -> str:
    """`message` with its control characters escaped (a newline in an engine's reason would forge a
    log line) and cut to EVENT_MESSAGE_CHARS (a megabyte reason would stay in the history)."""
    message = CONTROL_CHARACTER.sub(lambda bad: repr(bad[0])[1:-1], message)
    if len(message) > EVENT_MESSAGE_CHARS:
        message = f"{message[:EVENT_MESSAGE_CHARS]}... ({len(message)} characters)"
    return message


class EventBus:
    def __init__(self, history: int = 500, queue_size: int = 10_000):
        self.sequence = 0
        self.recent: collections.deque[controller_pb2.Event] = collections.deque(maxlen=history)
        self.subscribers: FanOut[controller_pb2.Event] = FanOut("WatchEvents", queue_size)
        self._repeating: dict[object, controller_pb2.Event] = {}  # key -> the event counting its tries

    def emit(
        self,
        type_: int,
        message: str,
        node_id: str = "",
        instance_id: str = "",
        engine_id: str = "",
        count: int = 0,
        deployment: str = "",
    ) -> controller_pb2.Event:
        """One event; `count`: how many occurrences it stands for (0: one, not counted)."""
        self.sequence += 1
        message = one_line(message)
        event = controller_pb2.Event(
            sequence=self.sequence,
            time=pbtime.now(),
            type=type_,
            node_id=node_id,
            instance_id=instance_id,
            engine_id=engine_id,
            message=message,
            count=count,
            deployment=deployment,
        )
        self.recent.append(event)
        kind = enum_short_name(controller_pb2.EventType, type_)
        # The ids and the reason as fields too, for JSON log lines (motor.service.logs).
        ids = {
            "event": kind.lower(),
            "node_id": node_id,
            "instance_id": instance_id,
            "engine_id": engine_id,
            "reason": message,
            "deployment": deployment,
        }
        logger.info("event %s: %s", kind, message, extra=ids)
        self.subscribers.publish(event)
        return event

    def repeat(
        self,
        key: object,
        type_: int,
        message: str,
        node_id: str = "",
        instance_id: str = "",
        engine_id: str = "",
        deployment: str = "",
    ) -> controller_pb2.Event:
        """One more occurrence of what `key` names: the first is a new event (count 1); later ones
        raise its count, take the latest message and time, and send it again (same sequence).
        Logged at counts 1, 10, 100..."""
        event = self._repeating.get(key)
        if event is None:
            if len(self._repeating) >= REPEATING_LIMIT:  # never settled (the operation was dropped): forget the oldest
                del self._repeating[next(iter(self._repeating))]
            event = self._repeating[key] = self.emit(
                type_, message, node_id, instance_id, engine_id, deployment=deployment
            )
            event.count = 1
            return event
        event.count += 1
        event.message = message = one_line(message)
        event.last_time.CopyFrom(pbtime.now())
        if worth_reporting(event.count):
            logger.info("event %s (x%d): %s", enum_short_name(controller_pb2.EventType, type_), event.count, message)
        self.subscribers.publish(event)
        return event

    def is_repeating(self, key: object) -> bool:
        return key in self._repeating

    def settle(self, key: object, outcome: str = "") -> int:
        """What `key` names stopped happening: a later occurrence is a new event. Returns its
        count. `outcome` ("stopped after 3 failed try(ies)") is added to the event's message and
        the event sent again: its last words were "trying again in 1s"."""
        event = self._repeating.pop(key, None)
        if event is None:
            return 0
        if outcome:
            event.message = one_line(f"{event.message} -> {outcome}")
            event.last_time.CopyFrom(pbtime.now())
            self.subscribers.publish(event)
        return event.count

    def subscribe(self) -> Subscription[controller_pb2.Event]:
        return self.subscribers.subscribe()


def concerns(event: controller_pb2.Event, deployment: str) -> bool:
    """Whether a WatchEvents stream for `deployment` ("": every event) sends `event`."""
    return not deployment or event.deployment == deployment
