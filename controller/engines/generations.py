"""Generations that stay ordered when the controller's store is lost, and the limit that keeps a
bogus start from planting one (docs/security.md#generations-and-epochs).

Every registration and every engine copy takes the next number of one counter in the store. A
node manager refuses a start older than a generation that already ran there, so a controller
whose store was lost (its counter back at 0) used to see every start refused as stale. Two
rules keep the numbers ordered without trusting a caller:
- learning: a generation a node reports (RegisterNode's `highest_generation`, an engine in a
  registration or a heartbeat) that this store never issued raises the counter above it;
- a limit: every RegisterNode/Heartbeat reply tells the node the highest generation this
  controller may send before the next reply (the counter plus WINDOW); the node refuses a start
  above it, so what a node reports is never more than WINDOW past what a controller issued.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from controller.store.interface import Store, StoreUnavailable

logger = logging.getLogger(__name__)

# How far past the counter a StartEngine may go before the node hears from the controller
# again: more generations than one reconcile pass issues at once (a 10,000-instance apply takes
# 40,000), so a start is refused (UNAVAILABLE, retried) only in a burst larger than that.
WINDOW = 1 << 20
# No controller issues a generation this large (the counter would need 2^62 starts); a node
# reporting one carries a record no controller wrote.
MAX_GENERATION = 1 << 62


class Generations:
    def __init__(self, store: Store, refused: Callable[[StoreUnavailable], None]):
        self.store, self.refused = store, refused

    def limit(self) -> int:
        return self.store.last_generation() + WINDOW

    def for_registration(self, highest_reported: int) -> int:
        """The registration's own generation, above everything the node reports (its engine
        records may come from a lost store's controller; claims.check_registration bounds it)."""
        return self.store.next_generation(above=highest_reported)

    def learn(self, generation: int, where: str) -> None:
        """An engine reported with a generation this store never issued: issue above it from now
        on (a value past the limit cannot come from a node that checks the limit: ignored)."""
        last = self.store.last_generation()
        if generation <= last or generation > last + WINDOW:
            return
        try:
            self.store.next_generation(above=generation)
        except StoreUnavailable as exc:
            self.refused(exc)
            return
        logger.warning(
            "%s reported generation %d, which this store never issued (its counter was at %d): "
            "later generations are issued above it",
            where,
            generation,
            last,
        )
