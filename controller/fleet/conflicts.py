"""Node-id conflicts under way: a second node manager process asking for a node id another live
process holds (controller/fleet/claims.py refuses it and logs it here; the node monitor,
controller/fleet/liveness.py, re-checks the holder when the newcomer keeps asking)."""

from __future__ import annotations

from dataclasses import dataclass

from motor.v1 import types_pb2


@dataclass
class Conflict:
    node_id: str
    newcomer: types_pb2.NodeManagerProcess
    newcomer_address: str
    message: str  # the latest refusal
    since_wall: float
    last_mono: float
    refused: int = 1


class ConflictLog:
    """Conflicts under way, one per (node id, newcomer process)."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, str], Conflict] = {}

    def refused(
        self, node_id: str, newcomer: types_pb2.NodeManagerProcess, address: str, message: str, wall: float, mono: float
    ) -> Conflict | None:
        """Count a refusal; returns the conflict when it is a new one (to announce)."""
        key = (node_id, newcomer.nonce)
        conflict = self._open.get(key)
        if conflict is not None:
            conflict.refused += 1
            conflict.message, conflict.last_mono = message, mono
            return None
        conflict = self._open[key] = Conflict(node_id, newcomer, address, message, wall, mono)
        return conflict

    def end(self, node_id: str, nonce: str) -> Conflict | None:
        return self._open.pop((node_id, nonce), None)

    def quiet(self, mono: float, after: float) -> list[Conflict]:
        """Remove and return the conflicts whose newcomer has not asked for `after` seconds."""
        done = [c for c in self._open.values() if mono - c.last_mono > after]
        for conflict in done:
            del self._open[(conflict.node_id, conflict.newcomer.nonce)]
        return done

    def asking(self, node_id: str, boot_id: str, since_mono: float) -> bool:
        """A process on host boot `boot_id` asked for `node_id` at `since_mono` or later."""
        return any(
            c.node_id == node_id and c.newcomer.boot_id == boot_id and c.last_mono >= since_mono
            for c in self._open.values()
        )

    def open(self) -> list[Conflict]:
        return sorted(self._open.values(), key=lambda c: (c.node_id, c.since_wall))
