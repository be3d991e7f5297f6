"""What "available" means for a deployment's instances, in one place: rollouts count it (a wave
withdraws an old unit only while enough stay available, COMPLETE only when the new revision's
count is available) and a change keeps available instances over others (controller/deploy/rollout_plan.py).

An instance is available when every engine of it is listed to the routers (controller/routing/endpoints.py:
READY or DEGRADED, running, NORMAL, not draining) and the front door routes to its URL; with a
settling time (a rollout's `min_ready`), when it has also been READY for that long.

The front door's view is given as two predicates over an endpoint's URL (controller/routing/door_reports.py
answers both; by default every listed endpoint counts as routed): `front_door`, "the front door
routes to it", for what counts as available (a rollout's progress, its COMPLETE), and `reached`,
"the front door may be sending it requests", for what stopping an instance would cost. They differ
while a front door's reports are stale: nothing counts as available through it, and everything it
held still counts as reached, so a change never takes an unknown for "nobody reaches it".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from controller.model.cluster import ClusterState
from controller.model.instances import READY, InstanceRecord
from controller.routing.endpoints import EndpointFeed

# "The front door routes to this endpoint URL."
FrontDoor = Callable[[str], bool]


def every_endpoint_routed(url: str) -> bool:
    return True


class Availability:
    def __init__(
        self,
        state: ClusterState,
        endpoints: EndpointFeed,
        front_door: FrontDoor = every_endpoint_routed,
        reached: FrontDoor = every_endpoint_routed,
    ):
        self.state, self.endpoints, self.front_door, self.reached = state, endpoints, front_door, reached

    def available(self, records: Sequence[InstanceRecord], settle: float | None = None) -> bool:
        """Every engine of `records` (one unit: an instance, or a prefill and its decode partner)
        listed to the routers and routed by the front door; with `settle` (seconds), every
        instance also READY for that long. An empty unit is not available."""
        return self._listed(records, settle, self.front_door)

    def serving(self, records: Sequence[InstanceRecord]) -> bool:
        """Listed and perhaps sent requests now, however recently it came back (what stopping it
        would cost)."""
        return self._listed(records, None, self.reached)

    def _listed(self, records: Sequence[InstanceRecord], settle: float | None, routed: FrontDoor) -> bool:
        if not records:
            return False
        now = self.state.wall()
        listed = self.endpoints.current
        for inst in records:
            if settle is not None and (
                inst.state != READY or inst.healthy_since is None or now - inst.healthy_since < settle
            ):
                return False
            for slot in self.state.slots_of(inst.instance_id):
                endpoint = listed.get(slot.engine_id)
                if endpoint is None or not routed(endpoint[3]):
                    return False  # not (or no longer) in the routers' workers
        return True
