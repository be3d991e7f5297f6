"""An engine's end: its exit watched (a pidfd; an exit nobody asked for, exit 0 included, is a
failure), what is left of its process tree killed, its ports released, and the controller told,
the not-serving notice first and FAILED only once the tree is gone.

A part of `NodeManager` (node_manager/manager.py), kept apart for its size: it uses the manager's
`ops`, `metrics`, `ports`, `refusals`, `reporter`, `node_id`, `_watchers`, `_closed`, `_spawn`,
`_changed` and `_stop_monitor`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from motor.contract.termination import read_termination_message
from motor.processes import ExitStatus, TreeId
from motor.v1 import types_pb2
from node_manager.engine import FAILED, Ending, EngineRecord, State, state_name
from node_manager.process_ops import ExitWatcher, Launched

logger = logging.getLogger(__name__)

# Lines of the engine's log quoted in the reason of an unexpected exit.
LOG_TAIL_LINES = 3


class EngineExits:
    def _watch(self, record: EngineRecord, child: Launched | None) -> None:
        record.watch = self.ops.watch_exit(
            record.pid, lambda status: self._on_exit(record, status), child=child, started=record.process_started
        )

    @staticmethod
    def _watcher(record: EngineRecord) -> ExitWatcher:
        assert record.watch is not None, f"engine {record.engine_id}: its exit is not watched"
        return record.watch

    def _on_exit(self, record: EngineRecord, status: ExitStatus) -> None:
        logger.info("engine %s: pid %d %s", record.engine_id, record.pid, status.describe())
        if self._closed:
            return
        # Claimed at once: a StopEngine arriving now waits for this instead. When a stop or a
        # kill is under way, that path records the exit.
        if record.claim_ending(Ending.EXIT):
            self._spawn(self._handle_exit(record, status))

    async def _handle_exit(self, record: EngineRecord, status: ExitStatus, while_away: bool = False) -> None:
        """An exit nobody asked for (exit code 0 included) is a failure."""
        self._stop_monitor(record)
        was = state_name(record.state)
        notice = None if while_away else self._not_serving(record, f"engine server {status.describe()}")
        # Children may outlive the engine server (an orphaned engine core holds accelerator memory).
        # After a restart the process group id may have been reused: use the token only then.
        tree = record.token_tree if while_away else record.tree
        survivors = await self._end_leftovers(record, tree)
        record.record_exit(status)
        self.refusals.engine_exited(
            record.requested, status.exit_code, read_termination_message(record.termination_path)
        )
        if while_away:
            reason = "exited while the node manager was not running (exit code unknown)"
        else:
            reason = f"{status.describe()} without being asked to stop (while {was})"
        if survivors:
            reason += f"; processes {survivors} of its tree survived SIGKILL"
        reason = record.explain(reason, LOG_TAIL_LINES)
        self._end(record, FAILED, reason)
        await self._report(record, reason, after=notice)

    def _not_serving(self, record: EngineRecord, why: str) -> asyncio.Task:
        """Tell the controller at once that the engine no longer serves (its endpoint leaves the
        routers' list), before its process tree is cleaned up. The engine stays active until the
        tree is gone: only FAILED, reported after that, lets the controller start a replacement
        (which then cannot collide with a leftover holding its ports or accelerators)."""
        record.health, record.health_reason = types_pb2.HEALTH_STATUS_ABNORMAL, why
        engine = record.to_proto(self.node_id)
        self._watchers.publish(engine)
        return self._spawn(self._report(record, f"{why}; ending its process tree", engine=engine))

    async def _end_leftovers(self, record: EngineRecord, tree: TreeId, remembered: Iterable | None = None) -> list[int]:
        """Kill what is left of an ended engine's tree; the pids that survived SIGKILL."""
        remembered = record.remembered if remembered is None else remembered
        left = await self.ops.find_tree(tree, remembered)
        if not left:
            return []
        logger.warning("engine %s: killing %d leftover process(es) of its tree: %s", record.engine_id, len(left), left)
        self.metrics.kill("orphans")
        survivors = await self.ops.kill_tree_confirmed(tree, remembered)
        if survivors:
            logger.error("engine %s: processes %s survived SIGKILL", record.engine_id, survivors)
        return survivors

    def _end(self, record: EngineRecord, state: State, reason: str) -> None:
        for port in record.allocated_ports:
            self.ports.release(port)
        record.transition(state, reason, self._changed)
        if state == FAILED:
            self.metrics.failures.labels(self.node_id).inc()
        record.settled.set()

    async def _report(
        self,
        record: EngineRecord,
        reason: str,
        engine: types_pb2.Engine | None = None,
        after: asyncio.Task | None = None,
    ) -> None:
        if after is not None:
            await after  # the not-serving notice: the controller must not hear of FAILED first
        if self.reporter is not None and not self._closed:
            try:
                await self.reporter(engine or record.to_proto(self.node_id), reason)
            except Exception:  # the next heartbeat carries the failure anyway
                logger.exception("engine %s: reporting the failure failed", record.engine_id)
