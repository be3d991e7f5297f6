"""Engine records written behind memory, so that a full disk never loses or hides an exit.

Memory describes what happened (an engine exited, was stopped): it is changed and published
first, whatever the disk says. A write the disk refuses (ENOSPC, EIO...) keeps the record as
unsaved; one background task writes every unsaved record again with backoff (1 s doubling to
30 s) until the disk takes them. A refused write is counted in the metrics and logged once per
spell, not per try; `failing` says why while the spell lasts (each heartbeat carries it, and
the controller raises an event). Only StartEngine asks the disk first (`require_writable`): it
starts nothing when the record of what it would start cannot be written, and the background
task then tries that write until the disk takes it, which ends the spell."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from motor.errors import Unavailable
from motor.v1 import types_pb2
from node_manager.engine import EngineRecord, RecordStore

logger = logging.getLogger(__name__)


class RecordSaver:
    RETRY_MIN_S = 1.0
    RETRY_MAX_S = 30.0

    def __init__(
        self,
        store: RecordStore,
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task],
        count_failure: Callable[[], None],
    ):
        self.store = store
        self._spawn = spawn
        self._count_failure = count_failure
        self.unsaved: dict[str, EngineRecord] = {}
        self._retrying: asyncio.Task | None = None
        self._probe: types_pb2.EngineSpec | None = None  # a refused write check, tried again too
        # Why records cannot be written, while they cannot (empty otherwise).
        self.failing = ""
        self._untold = ""  # a spell that ended before any heartbeat carried it

    def for_heartbeat(self) -> str:
        """What the next heartbeat says: the spell under way, or one that began and ended since the
        last beat (told once, so a short spell still reaches the operator)."""
        told, self._untold = self.failing or self._untold, ""
        return told

    def save(self, record: EngineRecord) -> bool:
        """Write the record now; on refusal keep it for the retry task. Never raises."""
        try:
            self.store.save(record)
        except OSError as exc:
            self._refused(record, exc)
            return False
        self.unsaved.pop(record.engine_id, None)
        return True

    def require_writable(self, spec: types_pb2.EngineSpec) -> None:
        """Unavailable (naming the cause and the fix) when the engine's record cannot be written."""
        try:
            self.store.probe(spec)
        except OSError as exc:
            self._probe = spec
            self._refused(None, exc)
            raise Unavailable(
                f"engine records cannot be written in {self.store.root} ({exc.strerror or exc}): nothing "
                "was started; free space on that disk (or fix it) and retry"
            ) from None

    def _refused(self, record: EngineRecord | None, exc: OSError) -> None:
        self._count_failure()
        self.failing = f"engine records cannot be written in {self.store.root} ({exc.strerror or exc})"
        self._untold = f"{self.failing} (written again since)"
        if record is not None:
            self.unsaved[record.engine_id] = record
        if self._retrying is None or self._retrying.done():
            logger.error(
                "%s: engine records and any later change are kept in memory, reported, and written again "
                "with backoff (first: %s)",
                self.failing,
                record.engine_id if record else "a write check",
            )
            self._retrying = self._spawn(self._write_again())

    async def _write_again(self) -> None:
        await asyncio.sleep(self.RETRY_MIN_S)
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(OSError),
            reraise=True,
            wait=wait_exponential(min=self.RETRY_MIN_S, max=self.RETRY_MAX_S),
            before_sleep=lambda state: self._count_failure(),
        ):
            with attempt:
                for engine_id, record in list(self.unsaved.items()):
                    self.store.save(record)  # as memory has it now
                    if self.unsaved.get(engine_id) is record:
                        del self.unsaved[engine_id]
                if self._probe is not None:
                    self.store.probe(self._probe)
                    self._probe = None
        self.failing = ""
        logger.info(
            "engine records are written again in %s (after %d refused retry(ies))",
            self.store.root,
            attempt.retry_state.attempt_number - 1,
        )
