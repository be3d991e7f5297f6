"""A set of background tasks that logs a task's failure and can be cancelled as a whole."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine, Iterator

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
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
