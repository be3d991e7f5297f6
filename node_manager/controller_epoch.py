"""The controller epoch a node manager has seen (docs/ha.md): a leader elected on etcd sends its
epoch on StartEngine/StopEngine and in its RegisterNode/Heartbeat replies. Once a node has seen
epoch N, a command of an older epoch comes from a deposed leader and is refused, even if that
leader still believes it leads. Epoch 0 is a controller without high availability (SQLite)."""

from __future__ import annotations

import logging

from motor.errors import FailedPrecondition
from motor.names import excerpt

logger = logging.getLogger(__name__)


class ControllerEpoch:
    def __init__(self) -> None:
        self.highest = 0

    def observe(self, epoch: int) -> None:
        if epoch > self.highest:
            if self.highest:
                logger.info("controller epoch %d -> %d: a new controller leads", self.highest, epoch)
            self.highest = epoch

    def admit(self, epoch: int, what: str) -> None:
        """Raise FailedPrecondition for a command of an epoch older than one seen; else note it."""
        if epoch and epoch < self.highest:
            raise FailedPrecondition(
                f"controller_epoch {epoch} refused ({excerpt(what, 200)}): epoch {self.highest} leads now "
                "(the sender is a deposed leader)"
            )
        self.observe(epoch)
