"""A set of background tasks that logs a task's failure and can be cancelled as a whole."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Iterator
from typing import Any

logger = logging.getLogger(__name__)


class TaskSet:
    """Keeps a reference to each running task (asyncio keeps only weak ones) until it ends."""

    def __init__(self, owner: str):
        self.owner = owner  # named in the log line of a failed task
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s: background task %s failed", self.owner, task.get_name(), exc_info=task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task]:
        return iter(list(self._tasks))

    async def cancel_all(self) -> None:
        """Cancel every task and wait until all have ended."""
        await cancel_and_wait(*self._tasks, owner=self.owner)


async def cancel_and_wait(*tasks: asyncio.Task, owner: str, patience: float = 2.0) -> None:
    """Cancel the tasks and wait until all have ended. A task still running after `patience`
    seconds swallowed its cancel (Python 3.11's asyncio.wait_for does when the awaited result
    lands in the same loop turn; some libraries catch CancelledError): it is cancelled again, with
    a warning, rather than letting a stop wait forever."""
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=patience)
        for task in pending:
            logger.warning(
                "%s: task %s is still running %gs after its cancel: cancelling it again",
                owner,
                task.get_name(),
                patience,
            )


async def set_within(event: asyncio.Event, timeout: float | None) -> bool:
    """Whether the event is set within `timeout` seconds (asyncio.timeout, not wait_for: see above)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()
    return event.is_set()
