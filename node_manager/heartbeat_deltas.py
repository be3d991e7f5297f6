"""A node's heartbeats as deltas (ControllerService.StreamHeartbeats): only the engines whose
report changed since the previous beat, plus the ids of engines gone; a full list on the first
beat of every stream (`restart()`) and every `full_every` beats, so a lost delta or a
controller that forgot the node's engines is repaired within that many beats. And the grid a
node's beats fall on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from motor.v1 import controller_pb2, types_pb2


class HeartbeatDeltas:
    def __init__(self, node_id: str, full_every: int = 30):
        if full_every < 1:
            raise ValueError("full_every must be at least 1")
        self.node_id = node_id
        self.full_every = full_every
        self.sequence = 0
        self._sent: dict[str, bytes] = {}  # engine id -> the report last sent, serialized
        self._since_full = 0
        self.restart()

    def restart(self) -> None:
        """The next beat is a full list (a new stream, a new registration)."""
        self._since_full = self.full_every

    def next(self, generation: int, engines: Iterable[types_pb2.Engine]) -> controller_pb2.HeartbeatRequest:
        self.sequence += 1
        now = {e.engine_id: (e, e.SerializeToString(deterministic=True)) for e in engines}
        request = controller_pb2.HeartbeatRequest(node_id=self.node_id, generation=generation, sequence=self.sequence)
        if self._since_full >= self.full_every:
            self._since_full = 1
            request.engines.extend(e for e, _ in now.values())
        else:
            self._since_full += 1
            request.delta = True
            request.engines.extend(e for eid, (e, raw) in now.items() if self._sent.get(eid) != raw)
            request.removed_engine_ids.extend(eid for eid in self._sent if eid not in now)
        self._sent = {eid: raw for eid, (_, raw) in now.items()}
        return request


def next_on_grid(after: float, interval: float, phase: float) -> float:
    """The first of the times (k + phase) x interval that comes at least a millisecond after
    `after`: a node beating on such a grid, at a random phase of its own, beats evenly spread
    with the rest of a fleet that was started at once (each one's schedule counted from its
    registration would beat in bursts), and is never more than one interval late for its
    next point, whatever the interval was before."""
    k = math.floor(after / interval - phase) + 1
    point = (k + phase) * interval
    return point + interval if point - after < 0.001 else point
