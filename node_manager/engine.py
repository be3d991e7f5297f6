"""One engine under a node manager: its record, its lifecycle state machine and its JSON form.

Lifecycle (one transition function, a reason on every transition):

    STARTING --first NORMAL--> RUNNING
    STARTING/RUNNING --StopEngine--> STOPPING --tree gone--> STOPPED
    STARTING/RUNNING --exit not asked for, or killed when abnormal--> FAILED
    STOPPING --processes survived SIGKILL--> FAILED

While the engine is active, `ending` says which path of the node manager is ending it (stop,
kill, or handling an exit): the first to claim it acts, the others leave the engine alone.

STOPPED and FAILED are final for a record: a later StartEngine creates a new record.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from motor.contract import pbtime
from motor.contract.names import engine_id as make_engine_id
from motor.contract.termination import read_termination_message
from motor.processes import ExitStatus, TreeId
from motor.state_machine import Transitions
from motor.v1 import types_pb2
from node_manager.log_excerpt import failure_excerpt
from node_manager.process_ops import ExitWatcher

logger = logging.getLogger(__name__)

State = int  # a types_pb2.EngineState value
STARTING = types_pb2.ENGINE_STATE_STARTING
RUNNING = types_pb2.ENGINE_STATE_RUNNING
STOPPING = types_pb2.ENGINE_STATE_STOPPING
STOPPED = types_pb2.ENGINE_STATE_STOPPED
FAILED = types_pb2.ENGINE_STATE_FAILED

ACTIVE_STATES = frozenset({STARTING, RUNNING, STOPPING})
FINAL_STATES = frozenset({STOPPED, FAILED})
TRANSITIONS = Transitions.between(
    {
        STARTING: frozenset({RUNNING, STOPPING, FAILED}),
        RUNNING: frozenset({STOPPING, FAILED}),
        STOPPING: frozenset({STOPPED, FAILED}),
        STOPPED: frozenset(),
        FAILED: frozenset(),
    },
    lambda state: state_name(state),
)
# Probe results kept as evidence for a failure report.
RECENT_PROBES = 5
# What an Engine message (ListEngines, heartbeats) says as the record holds it.
AS_REPORTED = (
    "engine_id",
    "spec",
    "state",
    "state_reason",
    "health",
    "health_reason",
    "consecutive_abnormal",
    "pid",
    "log_path",
    "draining",
    "sleeping",
    "not_serving_reason",
    "in_flight_requests",
)


def state_name(state: State) -> str:
    return types_pb2.EngineState.Name(state).removeprefix("ENGINE_STATE_")


class Ending(enum.Enum):
    """Who ends an active engine: one path at a time, the others leave it alone. Set while the
    engine is STARTING, RUNNING or STOPPING, until it reaches STOPPED or FAILED."""

    NONE = "none"
    STOP = "stop"  # StopEngine or fencing: SIGTERM, deadline, SIGKILL
    KILL = "kill"  # the node manager's kill decision on an abnormal verdict
    EXIT = "exit"  # an exit nobody asked for is being handled (or happened while away)


@dataclass
class EngineRecord:
    """Everything the node manager knows about one engine (persisted, except the runtime part)."""

    spec: types_pb2.EngineSpec  # as launched: ports, host and config path filled in
    requested: types_pb2.EngineSpec  # as asked for (idempotency: compared with a repeated StartEngine)
    log_path: str
    token: str  # tags the engine's processes (motor.processes.TOKEN_ENV)
    state: State = STARTING
    state_reason: str = ""
    state_changed_at: float = field(default_factory=time.time)
    started_at: float = field(default_factory=time.time)
    pid: int = 0
    pgid: int = 0
    process_started: float | None = None  # the process's create time: guards against pid reuse
    exit_code: int | None = None
    exit_signal: int | None = None
    allocated_ports: list[int] = field(default_factory=list)
    health: int = types_pb2.HEALTH_STATUS_UNSPECIFIED
    health_reason: str = "engine server has not answered yet"
    consecutive_abnormal: int = 0
    ever_answered: bool = False
    stream_heard_at: float = 0.0  # time.monotonic() of the last message on the probe stream
    last_probe: types_pb2.ProbeResult | None = None
    recent_probes: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RECENT_PROBES))
    remembered: list[tuple[int, float]] = field(default_factory=list)  # descendants seen alive
    # What the engine server last said of itself (GetStatus / its probe stream).
    stop_grace: float = 0.0  # seconds a SIGTERM may take to end it: a stop waits at least this
    draining: bool = False
    sleeping: bool = False
    not_serving_reason: str = ""  # the engine's stall watchdog: '' while it serves
    in_flight_requests: int = 0  # reported to the controller
    in_flight_average: float | None = None  # over the engine's last second: the autoscaler's signal
    # Runtime only -------------------------------------------------------------------------
    watch: ExitWatcher | None = None  # notices the engine server's exit
    ending: Ending = Ending.NONE  # who is ending the engine, once something is
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # set once in a final state

    @property
    def engine_id(self) -> str:
        return make_engine_id(self.spec.instance_id, self.spec.dp_rank)

    @property
    def generation(self) -> int:
        return self.spec.generation

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def termination_path(self) -> str:
        """Where the engine server writes its cause of exit (--termination-message-path)."""
        return termination_path(self.log_path)

    def observe_status(self, status: types_pb2.EngineStatus) -> bool:
        """Take what a status says of the engine besides its health; True when draining, sleeping
        or not serving changed (routers must hear of it: the engine stops serving or serves again)."""
        if status.HasField("stop_grace"):
            self.stop_grace = pbtime.seconds(status.stop_grace)
        self.in_flight_requests = status.in_flight_requests
        self.in_flight_average = status.in_flight_average if status.HasField("in_flight_average") else None
        now = (status.draining, status.sleeping, status.not_serving_reason)
        changed = (self.draining, self.sleeping, self.not_serving_reason) != now
        self.draining, self.sleeping, self.not_serving_reason = now
        return changed

    @property
    def serving_words(self) -> str:
        """Why the engine does not serve, or 'serving again' (the report of a change)."""
        if self.draining:
            return "draining"
        if self.sleeping:
            return "sleeping"
        if self.not_serving_reason:
            return f"not serving: {self.not_serving_reason}"
        return "serving again"

    @property
    def tree(self) -> TreeId:
        return TreeId(pid=self.pid, pgid=self.pgid or self.pid, token=self.token, started=self.process_started)

    @property
    def token_tree(self) -> TreeId:
        """The tree found by token only: once the engine has ended, its pid and process group
        id may belong to someone else."""
        return TreeId(pid=0, pgid=0, token=self.token, started=self.process_started)

    @property
    def being_ended(self) -> bool:
        return self.ending is not Ending.NONE

    def claim_ending(self, ending: Ending) -> bool:
        """The one way to set `ending`: True when the caller now ends this active engine, False
        when something else already does (or it has ended): then the caller leaves it alone."""
        if not self.active or self.being_ended:
            return False
        self.ending = ending
        return True

    def transition(self, new_state: State, reason: str, on_change: Callable[[EngineRecord, State], None]) -> None:
        """The one way to change state; `on_change(record, old_state)` persists and publishes."""
        TRANSITIONS.check(self.engine_id, self.state, new_state, reason)
        old = self.state
        self.state, self.state_reason, self.state_changed_at = new_state, reason, time.time()
        logger.info(
            "engine %s: %s -> %s: %s",
            self.engine_id,
            state_name(old),
            state_name(new_state),
            reason,
            extra={"event": state_name(new_state).lower(), "reason": reason},
        )
        on_change(self, old)

    def record_exit(self, status: ExitStatus) -> None:
        self.exit_code, self.exit_signal, self.pid = status.exit_code, status.signal, 0

    def remember(self, descendants: list[tuple[int, float]], same_process: Callable[[int, float], bool]) -> None:
        """Keep the (pid, create time) of descendants seen alive: children re-parented to init
        after their parent died can still be found and killed."""
        known = {pid for pid, _ in self.remembered}
        self.remembered += [item for item in descendants if item[0] not in known]
        if len(self.remembered) > 256:
            self.remembered = [item for item in self.remembered if same_process(*item)]

    def explain(self, reason: str, tail_lines: int) -> str:
        """A failure's reason: the engine server's own word on why first (its termination
        message), then `reason`, the last `tail_lines` of its log last."""
        message = read_termination_message(self.termination_path)
        if message is not None:
            reason = f"{message.message}; {reason}"
        tail = self.log_tail(tail_lines)
        return f"{reason}; log: {tail}" if tail else reason

    def add_probe(self, probe: types_pb2.ProbeResult) -> None:
        self.last_probe = probe
        self.recent_probes.append(probe)

    def log_tail(self, count: int) -> str:
        """The last `count` lines of the engine's log that may explain its failure (node_manager/log_excerpt.py)."""
        try:
            with open(self.log_path, "rb") as handle:
                handle.seek(max(0, os.path.getsize(self.log_path) - 8192))
                text = handle.read().decode(errors="replace")
        except OSError:
            return ""
        return failure_excerpt(text, count)

    # Views ------------------------------------------------------------------------------------

    def to_proto(self, node_id: str) -> types_pb2.Engine:
        engine = types_pb2.Engine(
            node_id=node_id,
            recent_probes=list(self.recent_probes),
            **{name: getattr(self, name) for name in AS_REPORTED},
        )
        if self.stop_grace:
            engine.stop_grace.CopyFrom(pbtime.duration(self.stop_grace))
        if self.in_flight_average is not None:
            engine.in_flight_average = self.in_flight_average
        if self.exit_code is not None:
            engine.exit_code = self.exit_code
        if self.exit_signal is not None:
            engine.exit_signal = self.exit_signal
        if self.last_probe is not None:
            engine.last_probe.CopyFrom(self.last_probe)
        engine.started_at.CopyFrom(pbtime.timestamp(self.started_at))
        engine.state_changed_at.CopyFrom(pbtime.timestamp(self.state_changed_at))
        return engine

    def to_json(self) -> dict[str, Any]:
        return {
            "spec": json_format.MessageToDict(self.spec),
            "requested": json_format.MessageToDict(self.requested),
            "log_path": self.log_path,
            "token": self.token,
            "state": state_name(self.state),
            "state_reason": self.state_reason,
            "state_changed_at": self.state_changed_at,
            "started_at": self.started_at,
            "pid": self.pid,
            "pgid": self.pgid,
            "process_started": self.process_started,
            "exit_code": self.exit_code,
            "exit_signal": self.exit_signal,
            "allocated_ports": self.allocated_ports,
            "remembered": self.remembered,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineRecord:
        return cls(
            spec=json_format.ParseDict(data["spec"], types_pb2.EngineSpec()),
            requested=json_format.ParseDict(data.get("requested", data["spec"]), types_pb2.EngineSpec()),
            log_path=data["log_path"],
            token=data["token"],
            state=types_pb2.EngineState.Value("ENGINE_STATE_" + data["state"]),
            state_reason=data.get("state_reason", ""),
            state_changed_at=data.get("state_changed_at", time.time()),
            started_at=data.get("started_at", time.time()),
            pid=data.get("pid", 0),
            pgid=data.get("pgid", 0),
            process_started=data.get("process_started"),
            exit_code=data.get("exit_code"),
            exit_signal=data.get("exit_signal"),
            allocated_ports=list(data.get("allocated_ports", [])),
            remembered=[tuple(item) for item in data.get("remembered", [])],
        )


def termination_path(log_path: str) -> str:
    """The engine's termination-message file, beside its log."""
    return os.path.splitext(log_path)[0] + ".termination"


def engine_dir_name(instance_id: str, dp_rank: int) -> str:
    return f"{instance_id}_rank{dp_rank}"


class RecordStore:
    """Engine records as JSON files, one directory per engine: <root>/<instance>_rank<r>/record.json.

    Writes are atomic (temporary file, fsync, rename): a crash leaves the old or the new record."""

    FILE = "record.json"

    def __init__(self, root: str):
        self.root = root
        # Every record write goes through here (tests replace it to replay a full disk: ENOSPC).
        self.write: Callable[[str, str], None] = atomic_write
        os.makedirs(root, exist_ok=True)

    def engine_dir(self, spec: types_pb2.EngineSpec) -> str:
        path = os.path.join(self.root, engine_dir_name(spec.instance_id, spec.dp_rank))
        os.makedirs(path, exist_ok=True)
        return path

    def save(self, record: EngineRecord) -> None:
        self.write(os.path.join(self.engine_dir(record.spec), self.FILE), json.dumps(record.to_json(), indent=1))

    def probe(self, spec: types_pb2.EngineSpec) -> None:
        """Raise the OSError a record write of this engine would meet now (a full disk)."""
        path = os.path.join(self.engine_dir(spec), ".writable")
        self.write(path, "record store write check\n")
        os.unlink(path)

    def load_all(self) -> list[EngineRecord]:
        records = []
        for name in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, name, self.FILE)
            if not os.path.exists(path):
                continue
            try:
                with open(path, encoding="utf-8") as handle:
                    records.append(EngineRecord.from_json(json.load(handle)))
            except (OSError, ValueError, KeyError, json_format.ParseError) as exc:
                logger.error("ignoring unreadable engine record %s: %s", path, exc)
        return records


def atomic_write(path: str, text: str) -> None:
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
