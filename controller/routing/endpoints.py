"""Which engines a router may send requests to (ListEndpoints), and the WatchEndpoints feed.

An engine is listed when it can serve right now:
- its instance is not a warm spare (controller/capacity/spares.py);
- its instance is READY, or DEGRADED (another rank is not NORMAL, this one still serves: with
  external load balancing every rank answers its own requests, and the controller is already
  restarting the other); never STARTING, RESTARTING, FAILED or PENDING;
- its node is READY, it runs (RUNNING) the current generation, its health is NORMAL;
- it is neither draining (Drain or SIGTERM: it answers new requests 503) nor sleeping;
- it serves: its stall watchdog gives no not-serving reason (requests in flight and no
  progress for stall_timeout, or requests failing with none succeeding). Its health stays
  NORMAL meanwhile: it leaves the routers at once and is killed only after stall_kill_after.

`EndpointFeed` keeps the listed set and, whenever something that decides it changes, works out
what was added and removed (once per event-loop turn, however many changes came in it) and
sends that to every WatchEndpoints stream (a change of tens of thousands of engines in slices
that yield to the loop, one message each). A change names the engines it may concern (an
engine, the ranks of an instance, the engines on a node), so the feed re-reads only those: a
failure in a fleet of 80,000 engines costs a handful of look-ups, not a pass over the fleet.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
from collections.abc import Iterable, Iterator

from controller.model.cluster import ClusterState
from controller.model.instances import DEGRADED, READY
from controller.model.nodes import NODE_READY
from controller.model.slots import EngineSlot
from controller.rules.slicing import Budget
from motor.service.fanout import FanOut, Subscription
from motor.v1 import controller_pb2, types_pb2

logger = logging.getLogger(__name__)

C, T = controller_pb2, types_pb2
SERVING_INSTANCE_STATES = (READY, DEGRADED)


def can_serve(state: ClusterState, slot: EngineSlot) -> bool:
    inst = state.instances.get(slot.instance_id)
    node = state.nodes.get(slot.node_id)
    if inst is None or inst.spare or inst.state not in SERVING_INSTANCE_STATES:
        return False
    if node is None or node.state != NODE_READY:
        return False
    if not slot.port or slot.state != T.ENGINE_STATE_RUNNING or slot.health != T.HEALTH_STATUS_NORMAL:
        return False
    return not (slot.draining or slot.sleeping or slot.not_serving_reason)


# What the feed keeps of a listed endpoint: (engine id, instance id, role, url, deployment,
# model names, KV-events address, tokenizer, generation). A tuple of strings and ints (the
# deployment's strings shared by its engines), which the garbage collector stops tracking, where
# an Endpoint message is one more tracked object (and a protobuf arena, about 500 bytes) per
# engine: the message is made when it is sent.
Listed = tuple[str, str, int, str, str, tuple[str, ...], str, str, int]


@functools.lru_cache(maxsize=256)
def tokenizer_of(config_json: str) -> str:
    """The tokenizer of an engine_config's prompts, for a KV-cache scorer: "sim" for the simulated
    engine, else its engine args' tokenizer or model ("" when it names none)."""
    try:
        config = json.loads(config_json)
    except ValueError:
        return ""
    for section in config.values() if isinstance(config, dict) else ():
        if isinstance(section, dict) and isinstance(section.get("engine_args"), dict):
            if section.get("engine_type") == "sim":
                return "sim"
            name = section["engine_args"].get("tokenizer") or section["engine_args"].get("model")
            return name if isinstance(name, str) else ""
    return ""


def listing(state: ClusterState, slot: EngineSlot | None) -> Listed | None:
    """What is listed of the slot, if it can serve."""
    if slot is None or not can_serve(state, slot):
        return None
    inst = state.instances[slot.instance_id]
    deployment = state.deployment_of(inst)
    # The model the instance was started to serve (a renamed model's old engines keep the old name).
    models = (inst.model,) if inst.model else state.deployments.served_models(deployment)
    adapters = state.engine_adapters.get(slot.engine_id)
    if adapters is not None and adapters.loaded:  # only the adapters that did load
        models = (*models, *sorted(adapters.loaded))
    kv_events, tokenizer = "", ""
    if slot.kv_events_port:  # (a controller started with --kv-events)
        kv_events, tokenizer = f"tcp://{slot.host}:{slot.kv_events_port}", tokenizer_of(state.config_of(inst))
    url = f"http://{slot.host}:{slot.port}"
    return slot.engine_id, slot.instance_id, inst.role, url, deployment, models, kv_events, tokenizer, slot.generation


def message(listed: Listed) -> C.Endpoint:
    engine_id, instance_id, role, url, deployment, models, kv_events, tokenizer, generation = listed
    return C.Endpoint(
        instance_id=instance_id,
        engine_id=engine_id,
        role=role,
        url=url,
        deployment=deployment,
        models=models,
        kv_events=kv_events,
        tokenizer=tokenizer,
        generation=generation,
    )


def endpoint(state: ClusterState, slot: EngineSlot | None) -> C.Endpoint | None:
    """The slot's endpoint, if it can serve."""
    listed = listing(state, slot)
    return None if listed is None else message(listed)


def endpoints(state: ClusterState, role: int = T.ROLE_UNSPECIFIED, model: str = "") -> list[C.Endpoint]:
    """The engines that can serve, of `role` (ROLE_UNSPECIFIED: every role) and answering to
    `model` (empty: any), by engine id."""
    out = []
    for engine_id in sorted(state.slots):
        found = endpoint(state, state.slots[engine_id])
        if (
            found is not None
            and (role == T.ROLE_UNSPECIFIED or found.role == role)
            and (not model or model in found.models)
        ):
            out.append(found)
    return out


class EndpointFeed:
    """The listed endpoints, and their changes streamed to WatchEndpoints subscribers."""

    def __init__(self, state: ClusterState, queue_size: int = 10_000):
        self.state = state
        self.current: dict[str, Listed] = {}
        self.subscribers: FanOut[C.WatchEndpointsResponse] = FanOut("WatchEndpoints", queue_size)
        self._scheduled = False
        self._everything = False  # every engine to re-read (queued at the next refresh)
        # Engine ids to re-read, in order; an id no longer in `_queued` was re-read meanwhile.
        self._queue: collections.deque[str] = collections.deque()
        self._queued: set[str] = set()
        # Every model name a deployment serves, as last sent (models_added/removed): a model here
        # with no endpoint is Motor's but not servable now (a front door answers 503, not 404).
        self.deployed: tuple[str, ...] = ()

    def changed(self, engine_ids: Iterable[str] | None = None) -> None:
        """Something that decides whether `engine_ids` (None: any engine) can serve may have
        changed: refresh once the current change is done (one refresh per event-loop turn,
        however many changes came in it)."""
        if engine_ids is None:
            self._everything = True
        else:
            self._enqueue(engine_ids)
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a unit test driving the tables): refresh now
            self.refresh(whole=True)
            return
        self._scheduled = True
        loop.call_soon(self.refresh)

    def _enqueue(self, engine_ids: Iterable[str]) -> None:
        queued, queue = self._queued, self._queue
        for engine_id in engine_ids:
            if engine_id not in queued:
                queued.add(engine_id)
                queue.append(engine_id)

    def refresh(self, whole: bool = False) -> None:
        """Re-read the engines changed since the last refresh and publish what was added and
        removed. A long list (a fleet-wide change: tens of thousands of engines) is re-read in
        slices of SLICE_SECONDS, one message each, the rest in the loop's next turn (`whole`: all
        now): each slice costs what it re-reads, not what is left (that waits in a queue)."""
        self._scheduled = False
        if self._everything:
            self._everything = False
            st = self.state
            self._enqueue(st.slots)
            self._enqueue([key for key in self.current if key not in st.slots])
        queue, queued = self._queue, self._queued

        def pending() -> Iterator[str]:
            while queue:
                key = queue.popleft()
                if key in queued:
                    queued.discard(key)
                    yield key

        self._reread(pending(), None if whole else Budget())
        if queue:
            self.changed(())  # the rest in the loop's next turn

    def refresh_engines(self, engine_ids: list[str]) -> None:
        """Re-read these engines now (an instance removed: routers hear of it before its engines stop)."""
        self._queued.difference_update(engine_ids)
        self._reread(engine_ids)

    def _reread(self, keys: Iterable[str], budget: Budget | None = None) -> None:
        """Publishes the changes among `keys` (all of them, or until `budget` is spent)."""
        added, removed = [], []
        for key in keys:
            old, new = self.current.get(key), listing(self.state, self.state.slots.get(key))
            if new != old:
                if old is not None:
                    removed.append(old)
                    del self.current[key]
                if new is not None:
                    added.append(new)
                    self.current[key] = new
            if budget is not None and budget.spent():
                break
        deployed = self.state.deployments.model_names()
        models_added = sorted(set(deployed) - set(self.deployed))
        models_removed = sorted(set(self.deployed) - set(deployed))
        if models_added or models_removed:
            logger.info("models served: added %s, removed %s", models_added or "none", models_removed or "none")
            self.deployed = deployed
        if added or removed or models_added or models_removed:
            added.sort()  # by engine id, the first of each tuple
            removed.sort()
            if added or removed:
                logger.info(
                    "endpoints: added %s, removed %s",
                    [e[0] for e in added] or "none",
                    [e[0] for e in removed] or "none",
                )
            self.subscribers.publish(
                C.WatchEndpointsResponse(
                    added=map(message, added),
                    removed=map(message, removed),
                    models_added=models_added,
                    models_removed=models_removed,
                )
            )

    def subscribe(self) -> Subscription[C.WatchEndpointsResponse]:
        """A stream starting with the snapshot (every listed endpoint), then every change."""
        self.refresh()
        listed = [message(self.current[k]) for k in sorted(self.current)]
        return self.subscribers.subscribe(
            [C.WatchEndpointsResponse(added=listed, snapshot=True, models_added=self.deployed)]
        )


def of_role(message: C.WatchEndpointsResponse, role: int, model: str = "") -> C.WatchEndpointsResponse | None:
    """The part of a feed message about `role` (ROLE_UNSPECIFIED: all) and `model` (empty: all);
    None when nothing is left of a change (a snapshot is always sent, even empty)."""
    if role == T.ROLE_UNSPECIFIED and not model:
        return message

    def wanted(e: C.Endpoint) -> bool:
        return (role == T.ROLE_UNSPECIFIED or e.role == role) and (not model or model in e.models)

    added = [e for e in message.added if wanted(e)]
    removed = [e for e in message.removed if wanted(e)]
    models_added = [name for name in message.models_added if not model or name == model]
    models_removed = [name for name in message.models_removed if not model or name == model]
    if not (added or removed or message.snapshot or models_added or models_removed):
        return None
    return C.WatchEndpointsResponse(
        added=added,
        removed=removed,
        snapshot=message.snapshot,
        models_added=models_added,
        models_removed=models_removed,
    )
