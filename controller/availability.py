"""What "available" means for a deployment's instances, in one place: rollouts count it (a wave
withdraws an old unit only while enough stay available, COMPLETE only when the new revision's
count is available) and a change keeps available instances over others (controller/rollout_plan.py).

An instance is available when every engine of it is listed to the routers (controller/endpoints.py:
READY or DEGRADED, running, NORMAL, not draining) and the front door routes to its URL; with a
settling time (a rollout's `min_ready`), when it has also been READY for that long.

The front door's view is injected (`Availability.front_door`, a predicate over an endpoint's URL):
by default every listed endpoint counts as routed; a controller told what the router really routes
to sets it, and from then on an engine the router does not route to is not available.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from controller.endpoints import EndpointFeed
from controller.instances import READY, InstanceRecord
from controller.state import ClusterState

# "The front door routes to this endpoint URL."
FrontDoor = Callable[[str], bool]


def every_endpoint_routed(url: str) -> bool:
    return True


class Availability:
    def __init__(self, state: ClusterState, endpoints: EndpointFeed, front_door: FrontDoor = every_endpoint_routed):
        self.state, self.endpoints, self.front_door = state, endpoints, front_door

    def available(self, records: Sequence[InstanceRecord], settle: float | None = None) -> bool:
        """Every engine of `records` (one unit: an instance, or a prefill and its decode partner)
        listed to the routers and routed by the front door; with `settle` (seconds), every
        instance also READY for that long. An empty unit is not available."""
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
                if endpoint is None or not self.front_door(endpoint[3]):
                    return False  # not (or no longer) in the routers' workers
        return True

    def serving(self, records: Sequence[InstanceRecord]) -> bool:
        """Available now, however recently it came back (what stopping it would cost)."""
        return self.available(records)
