"""How the engine server learns that its in-process vLLM died, from whichever side sees it first:
the engine-core process exiting (motor.processes.ExitWatch: noticed at once, even while vLLM's
loop is stuck), vLLM's output handler stopping (EngineDeadError), or vLLM's HTTP server stopping
on its own. The first reason is kept. Once the engine is stopping none counts: its end is expected.
A hung engine core (e.g. SIGSTOP) is not death: `/health` stays 200 and only probes notice it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from motor.contract.exits import describe_returncode
from motor.processes import ExitWatch, create_time

logger = logging.getLogger(__name__)

# Polls (10 ms apart) for an engine-core exit code that vLLM's monitor thread is storing.
EXIT_CODE_POLLS = 50
# How long a death seen by vLLM's side waits for the engine-core process's own exit report.
DEATH_REASON_GRACE_S = 0.2


class VllmDeath:
    """One vLLM engine's death: the reason, from the engine server's loop (`main_loop`)."""

    def __init__(self) -> None:
        self.main_loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False
        self.core_pids: list[int] = []  # each leads its own process group (vllm_engine_core)
        self._watches: list[ExitWatch] = []
        self._dead = asyncio.Event()
        self._reason = ""
        self._report: asyncio.Task | None = None  # kept: not collected mid-way

    async def wait(self) -> str:
        await self._dead.wait()
        return self._reason

    def declare(self, reason: str) -> None:
        """Only on the engine server's loop (use notify from the vLLM loop)."""
        if self.stopping or self._dead.is_set():
            return
        logger.error("vLLM engine died: %s", reason)
        self._reason = reason
        self._dead.set()

    def notify(self, reason: str) -> None:
        """From the vLLM loop. When the engine core died, vLLM's side often notices first (its
        sockets close before the process can be reaped): wait briefly, so that the reason names
        the process and its exit status when that is the cause."""
        if self.main_loop is not None and not self.main_loop.is_closed():
            self.main_loop.call_soon_threadsafe(self.main_loop.call_later, DEATH_REASON_GRACE_S, self.declare, reason)

    def watch_engine_core(self, processes: list[Any]) -> None:
        """On the engine server's loop: the engine-core processes (multiprocessing.Process)."""
        self.core_pids = [proc.pid for proc in processes]
        for proc in processes:
            # ExitWatch confirms a real exit (no false alarm from a spurious wake-up, vLLM
            # #54184) and leaves the reaping to multiprocessing, which owns the child.
            watch = ExitWatch(
                proc.pid, lambda _status, proc=proc: self._on_engine_core_exit(proc), started=create_time(proc.pid)
            )
            watch.start()
            self._watches.append(watch)
        logger.info("watching vLLM engine core: %s", ", ".join(f"{p.name} pid {p.pid}" for p in processes))

    def stop(self) -> None:
        """The engine is being stopped: from now on its processes' ends are no death."""
        self.stopping = True
        for watch in self._watches:
            watch.close()
        self._watches.clear()

    def on_output_handler_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            self.notify("vLLM's output handler was cancelled")
        else:
            self.notify("vLLM's output handler stopped (EngineDeadError): the engine core failed")

    def on_serve_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            reason = "cancelled"
        elif task.exception() is not None:
            reason = f"{type(task.exception()).__name__}: {task.exception()}"
        else:
            reason = "it exited"
        self.notify(f"vLLM's HTTP server stopped ({reason})")

    def _on_engine_core_exit(self, proc: Any) -> None:
        self._report = asyncio.get_running_loop().create_task(self._engine_core_died(proc))

    async def _engine_core_died(self, proc: Any) -> None:
        # multiprocessing reaps it here, or vLLM's monitor thread is reaping it right now: then
        # its exit code lands on `proc` a moment later (our own waitpid found nothing to reap).
        for _ in range(EXIT_CODE_POLLS):
            if proc.exitcode is not None:
                break
            await asyncio.sleep(0.01)
        self.declare(f"engine-core process {proc.name} (pid {proc.pid}) {describe_returncode(proc.exitcode)}")
