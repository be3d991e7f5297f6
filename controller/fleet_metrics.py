"""The controller's per-node, per-instance and per-engine series, and the engine list Prometheus
discovers its engine targets from (http_sd_configs).

State series are one-hot (kube-state-metrics' style): for each node, instance or engine, one
sample per possible state, 1 for the current one, so that `== 1` selects and `for:` works.

At fleet scale these are hundreds of thousands of samples (10,000 nodes x 8 engines: 400,000,
some 40 MB of text), which prometheus_client would rebuild and format on every scrape, on the
controller's event loop, for seconds. So they are rendered here instead, straight from the
controller's tables, and the text is kept between scrapes in blocks of rows (`KeptBlocks`),
each with what its rows showed when it was made (the rows themselves, a state, a node, a restart
count). A scrape reads those fields of a block's rows in C (`operator.attrgetter` over the
block) and compares them with the kept ones (list equality): only a block where something
changed is made again, the others are sent as they are. Only the heartbeat ages are new numbers
at every scrape. The
scrape yields to the loop every `chunk` rows, so heartbeats are answered while a large fleet is
being scraped, and what it takes of the loop in all stays a few tens of milliseconds at 10,000
x 8 (bench/metrics_scrape.py). Each block's lines are consistent; a scrape of a large fleet
spans a few loop turns, like any scrape of a changing system.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from controller.state import ClusterState
from motor.clock import SYSTEM_CLOCK, Clock
from motor.contract.names import enum_short_name, role_name
from motor.v1 import controller_pb2, types_pb2


def _states(enum_type) -> list[tuple[int, str]]:
    return [(v, enum_short_name(enum_type, v).lower()) for v in enum_type.values() if v]


NODE_STATES = _states(controller_pb2.NodeState)
INSTANCE_STATES = _states(controller_pb2.InstanceState)
HEALTH_STATES = _states(types_pb2.HealthStatus)

# name, type, help: the exposition header of each family, in the order they are written.
NODE_STATE = (
    "motor_controller_node_state",
    "gauge",
    "State of each node, 1 for the current one. lost: its engines are being moved (alert MotorNodeLost); "
    "suspect: silent and being re-checked.",
)
HEARTBEAT_AGE = (
    "motor_controller_node_heartbeat_age_seconds",
    "gauge",
    "Seconds since each node's last heartbeat. Above the node grace (motor_controller_node_grace_seconds) the node is "
    "suspect; steadily rising "
    "ages on many nodes at once point at the controller's network.",
)
SILENT_ALARM = (
    "motor_controller_silent_nodes_alarm",
    "gauge",
    "1 while more than silent_share_alarm of the nodes are silent at once: the controller suspects its "
    "own network and declares none of them lost (nothing is rescheduled). Check the controller's network.",
)
INSTANCE_STATE = (
    "motor_controller_instance_state",
    "gauge",
    'State of each instance, 1 for the current one; a warm spare\'s lines carry spare="true". Not ready for '
    "long: `motorctl instances` gives the reason (alert MotorInstanceNotReady).",
)
ENGINE_HEALTH = (
    "motor_controller_engine_health",
    "gauge",
    "Health of each engine as its node manager last reported it, 1 for the current one. abnormal: its "
    "probes fail; the node manager restarts it after abnormal_threshold heartbeats.",
)
ENGINE_RESTARTS = (
    "motor_controller_engine_restarts_total",
    "counter",
    "Restarts of each engine by the restart policy. Several in a few minutes is a crash loop (alert "
    "MotorEngineCrashLooping): read the engine's last failure reason.",
)


def header(family: tuple[str, str, str]) -> str:
    name, kind, help_text = family
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n"


def label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def labels(**pairs: str) -> str:
    return ",".join(f'{k}="{label_value(v)}"' for k, v in pairs.items())


def one_hot(name: str, label_text: str, states: list[tuple[int, str]], current: int, key: str) -> str:
    return "".join(
        f'{name}{{{label_text},{key}="{state_name}"}} {1 if value == current else 0}\n' for value, state_name in states
    )


# Rows whose text is kept and made again together: a changed row costs its block's text.
BLOCK = 100


class KeptBlocks:
    """One family's text, kept between scrapes in blocks of rows with what the rows showed when it
    was made: the rows themselves (a row's ids, group and role are never reassigned: a new
    record is a new object) and the `fields` that change, read a column at a time (lists of the
    rows' own values, no new object per row). A block is made again (`make(rows)`) when they
    differ, or when `still(text)` says the text no longer holds. Blocks are counted from the
    start of the table (its insertion order), so a row added or removed in the middle makes the
    blocks after it again once."""

    def __init__(self, *fields: str):
        self.columns = [attrgetter(f) for f in fields]
        self.kept: list[tuple[list, Any]] = []

    def made(
        self,
        index: int,
        rows: list,
        kept: list[tuple[list, Any]],
        make: Callable[[list], Any],
        still: Callable[[Any], bool] | None = None,
    ) -> Any:
        """Block `index`'s text, appended to `kept` (the next scrape's); made again if its rows changed."""
        shown = [rows]
        shown += [list(map(column, rows)) for column in self.columns]
        block = self.kept[index] if index < len(self.kept) else None
        if block is None or block[0] != shown or (still is not None and not still(block[1])):
            block = (shown, make(rows))
        kept.append(block)
        return block[1]


class FleetSeries:
    """Renders the fleet series from `state`'s tables; `alarm()` is the silent-nodes alarm's
    message ("" when off); `clock.time()` is read for heartbeat ages."""

    def __init__(self, state: ClusterState, alarm: Callable[[], str], clock: Clock = SYSTEM_CLOCK, chunk: int = 500):
        self.state, self.alarm, self.clock, self.chunk = state, alarm, clock, chunk
        self._nodes = KeptBlocks("state")
        self._instances = KeptBlocks("state", "spare")
        # One check of an engine's fields serves both of its families (`EngineLines`).
        self._engines = KeptBlocks("node_id", "health", "restarts")

    async def render(self) -> AsyncIterator[bytes]:
        """The exposition text of every fleet series, a block of rows at a time (the kept text
        itself, not copied); the loop runs every `chunk` rows."""
        nodes: list[tuple[Any, list]] = []  # (kept texts, rows) of each block read
        yield header(NODE_STATE).encode()
        async for blocks in self._pieces(list(self.state.nodes.values()), self._nodes, node_lines):
            nodes += blocks
            for text, _ in blocks:
                yield text[0]
        now = self.clock.time()
        yield header(HEARTBEAT_AGE).encode()
        async for blocks in self._again(nodes):
            # (a node restored from the store has not heartbeated yet: no age)
            yield "".join(
                [
                    f"{name}{max(0.0, now - n.last_heartbeat_wall):.3f}\n"
                    for (_, names), rows in blocks
                    for name, n in zip(names, rows)
                    if n.last_heartbeat_wall
                ]
            ).encode()
        yield (header(SILENT_ALARM) + f"{SILENT_ALARM[0]} {1 if self.alarm() else 0}\n").encode()
        instances = dict(self.state.instances)
        yield header(INSTANCE_STATE).encode()
        async for blocks in self._pieces(list(instances.values()), self._instances, instance_lines):
            for text, _ in blocks:
                yield text
        # Engines of instances that are gone (a deployment change under way) are left out.
        engines: list[tuple[Any, list]] = []
        yield header(ENGINE_HEALTH).encode()
        async for blocks in self._pieces(
            list(self.state.slots.values()),
            self._engines,
            lambda rows: EngineLines.of(rows, instances),
            lambda lines: lines.hold(instances),
        ):
            engines += blocks
            for lines, _ in blocks:
                yield lines.health
        # The restart counts as the blocks just read showed them (each block's lines consistent).
        yield header(ENGINE_RESTARTS).encode()
        async for blocks in self._again(engines):
            for lines, _ in blocks:
                yield lines.restarts

    async def _pieces(
        self, rows: list, kept: KeptBlocks, make: Callable[[list], Any], still: Callable[[Any], bool] | None = None
    ) -> AsyncIterator[list[tuple[Any, list]]]:
        """`rows` in pieces of `chunk` rows, each piece its blocks' (kept text, rows); the loop runs
        between pieces. The blocks read are kept for the next scrape."""
        size = min(BLOCK, self.chunk)
        made: list[tuple[list, Any]] = []
        for begin in range(0, len(rows), self.chunk):
            piece = []
            for start in range(begin, min(begin + self.chunk, len(rows)), size):
                block = rows[start : start + size]
                piece.append((kept.made(len(made), block, made, make, still), block))
            yield piece
            await asyncio.sleep(0)
        kept.kept = made

    async def _again(self, blocks: list[tuple[Any, list]]) -> AsyncIterator[list[tuple[Any, list]]]:
        """Blocks `_pieces` read, again in pieces of `chunk` rows (a second family of the same rows)."""
        per_piece = self.chunk // min(BLOCK, self.chunk)
        for begin in range(0, len(blocks), per_piece):
            yield blocks[begin : begin + per_piece]
            await asyncio.sleep(0)


def node_lines(nodes: list) -> tuple[bytes, list[str]]:
    """A block of nodes' state lines, and the text before each one's heartbeat age (only the
    number is new at each scrape)."""
    states = "".join(one_hot(NODE_STATE[0], labels(node_id=n.node_id), NODE_STATES, n.state, "state") for n in nodes)
    return states.encode(), [f"{HEARTBEAT_AGE[0]}{{{labels(node_id=n.node_id)}}} " for n in nodes]


# A warm spare's instance lines carry spare="true" (a promotion moves its lines to the serving ones).
SPARE_LABEL: dict[bool, dict[str, str]] = {False: {}, True: {"spare": "true"}}


def instance_lines(instances: list) -> bytes:
    return "".join(
        one_hot(
            INSTANCE_STATE[0],
            labels(instance_id=i.instance_id, group=i.group, role=role_name(i.role), **SPARE_LABEL[i.spare]),
            INSTANCE_STATES,
            i.state,
            "state",
        )
        for i in instances
    ).encode()


@dataclass(frozen=True, slots=True)
class EngineLines:
    """The health and restart lines of a block of engines, without the engines whose instance
    was gone when they were made (`complete` False then: made again at every scrape until the
    deployment change is over)."""

    health: bytes
    restarts: bytes
    instance_ids: frozenset[str]
    complete: bool

    @classmethod
    def of(cls, slots: list, instances: dict) -> EngineLines:
        ids = frozenset(s.instance_id for s in slots)
        kept = slots if ids <= instances.keys() else [s for s in slots if s.instance_id in instances]
        return cls(health_lines(kept), restart_lines(kept), ids, len(kept) == len(slots))

    def hold(self, instances: dict) -> bool:
        """Whether these lines still hold with `instances` (a dozen lookups for a block of 100 engines)."""
        return self.complete and self.instance_ids <= instances.keys()


def health_lines(slots: list) -> bytes:
    return "".join(
        one_hot(
            ENGINE_HEALTH[0],
            labels(instance_id=s.instance_id, engine_id=s.engine_id, node_id=s.node_id),
            HEALTH_STATES,
            s.health,
            "health",
        )
        for s in slots
    ).encode()


def restart_lines(slots: list) -> bytes:
    return "".join(
        f"{ENGINE_RESTARTS[0]}{{{labels(instance_id=s.instance_id, engine_id=s.engine_id)}}} {s.restarts}\n"
        for s in slots
    ).encode()


def engine_targets(state: ClusterState) -> list[dict]:
    """Prometheus HTTP service discovery: every placed engine's inference address (its /metrics), with
    its ids, its deployment and the deployment's model as labels (every series scraped from it carries
    them: request-level panels and alerts group by deployment). Served on the controller's metrics
    port at /discovery/engines."""
    targets = []
    instances = state.instances
    for slot in state.slots.values():
        inst = instances.get(slot.instance_id)
        if inst is None or not (slot.host and slot.port):
            continue
        deployment = state.deployment_of(inst)
        labels_ = {
            "instance_id": slot.instance_id,
            "engine_id": slot.engine_id,
            "node_id": slot.node_id,
            "role": role_name(inst.role),
            "deployment": deployment,
            "model": next(iter(state.served_models.get(deployment, ())), ""),
        }
        targets.append({"targets": [f"{slot.host}:{slot.port}"], "labels": labels_})
    return targets
