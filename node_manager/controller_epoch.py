"""Which controller commands are current, as a node manager judges them (docs/security.md,
"Generations and epochs"; docs/ha.md). One rule for high availability and for a lost store:

The controller this node manager reports to is the authority. Each of its RegisterNode and
Heartbeat replies (calls this node made, to the controller it is configured with) carries its
epoch (0 without high availability) and the highest generation it may put on a StartEngine
before its next reply. Only those replies teach the node anything. A StartEngine/StopEngine
(which, in plaintext mode, anyone reaching the port can send) is checked and teaches nothing:
- an epoch older than the reply's: a deposed leader: FAILED_PRECONDITION;
- an epoch more than one past it: UNAVAILABLE (one past is a new leader whose first reply has
  not reached this node yet; more is either not issued by any controller, or a leader after
  several quick elections: it retries once the node's next heartbeat brought its epoch); epoch 0
  is always accepted (a controller without high availability, grpcurl by hand);
- a start's generation above the announced limit: UNAVAILABLE (the controller retries once the
  node's next heartbeat has brought the new limit).
So one bogus command cannot poison the node: nothing it carries is kept. A reply whose epoch is
lower than the previous one replaces it (the controller's store was replaced: its election
epochs started again); under HA two controllers never answer as leader at the same time.
"""

from __future__ import annotations

import logging

from motor.contract.names import excerpt
from motor.errors import FailedPrecondition, Unavailable

logger = logging.getLogger(__name__)


class ControllerEpoch:
    def __init__(self) -> None:
        self.heard = False  # no reply yet (a standalone node manager): nothing is checked
        self.current = 0  # the epoch in the controller's latest reply
        self.generation_limit = 0  # 0: no reply yet (a standalone node manager): generations unchecked

    def observe(self, epoch: int, generation_limit: int = 0) -> None:
        """A reply of the controller this node reports to: it says what is current."""
        self.heard = True
        if epoch != self.current:
            if epoch > self.current:
                logger.info("controller epoch %d -> %d: a new controller leads", self.current, epoch)
            else:
                logger.warning(
                    "controller epoch %d -> %d: the controller's store was replaced (its epochs started "
                    "again); following it",
                    self.current,
                    epoch,
                )
            self.current = epoch
        if generation_limit:
            self.generation_limit = generation_limit

    def admit(self, epoch: int, what: str) -> None:
        """Raise for a command whose epoch is not current (FailedPrecondition: older; Unavailable:
        more than one ahead); learn nothing from it."""
        if not epoch or not self.heard or self.current <= epoch <= self.current + 1:
            return
        refused = f"controller_epoch {epoch} refused ({excerpt(what, 200)}): "
        if epoch < self.current:
            raise FailedPrecondition(refused + f"epoch {self.current} leads now (the sender is a deposed leader)")
        raise Unavailable(
            refused + f"the controller this node reports to announced epoch {self.current}; a leader "
            "of a later epoch is obeyed once the node's next heartbeat has brought it (retry)"
        )

    def admit_generation(self, generation: int, what: str) -> None:
        """Raise Unavailable for a start above the generation limit the controller announced."""
        if self.generation_limit and generation > self.generation_limit:
            raise Unavailable(
                f"spec.generation {generation} refused ({excerpt(what, 200)}): above the limit {self.generation_limit} "
                "the controller announced to this node; a controller retries after the node's next heartbeat"
            )
