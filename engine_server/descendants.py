"""Nothing of the engine server outlives it: the node manager watches the engine server's pid
and must never find part of its tree still running after that pid exited.

vLLM's engine core leads its own process group (vllm_engine_core) and may leave workers behind
when it is killed: re-parented to init, they are no longer this process's descendants, so the
engine's process groups are searched too. multiprocessing's resource tracker (a child that
ignores SIGTERM and SIGINT) exits only when its pipe is closed by every process holding it. At
exit the engine server gives its descendants a grace period, kills what is left, and stops the
resource tracker the way multiprocessing does (closing the pipe, so it still cleans up what it
tracks), waiting for each.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterable

import psutil

from motor.processes import wait_gone

logger = logging.getLogger(__name__)

# How long the descendants get to exit by themselves at a clean stop (vLLM kills its engine core
# itself; its workers follow within a few hundred milliseconds).
CLEAN_EXIT_GRACE_S = 3.0


def _resource_tracker_pid() -> int | None:
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_pid", None)


async def _stop_resource_tracker(timeout: float) -> None:
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop is None or _resource_tracker_pid() is None:
        return
    # A daemon thread, not the loop's executor: asyncio.run would wait for a stuck one at exit.
    done = threading.Event()
    threading.Thread(target=lambda: (stop(), done.set()), name="stop-resource-tracker", daemon=True).start()
    if not await asyncio.to_thread(done.wait, timeout):
        logger.warning("multiprocessing's resource tracker did not stop within %gs", timeout)


def _processes(groups: Iterable[int]) -> list[psutil.Process]:
    """This process's descendants and the members of `groups`, without itself and the tracker."""
    me, groups = os.getpid(), set(groups)
    skip = {me, _resource_tracker_pid()}
    found: dict[int, psutil.Process] = {}
    try:
        found.update((p.pid, p) for p in psutil.Process(me).children(recursive=True))
    except psutil.Error:
        pass
    if groups:
        for proc in psutil.process_iter():
            try:
                if os.getpgid(proc.pid) in groups:
                    found.setdefault(proc.pid, proc)
            except (ProcessLookupError, psutil.Error):
                continue
    return [p for pid, p in found.items() if pid not in skip]


async def end_descendants(grace: float, groups: Iterable[int] = (), kill_timeout: float = 5.0) -> list[psutil.Process]:
    """Wait up to `grace` seconds for every descendant and every member of the engine's process
    `groups` to exit, SIGKILL the rest, stop the resource tracker; returns what is still alive
    (empty on success)."""
    procs = await asyncio.to_thread(_processes, groups)
    left = await wait_gone(procs, grace) if procs else []
    if left:
        # After a death that is expected (grace 0); after a clean stop it is worth a warning.
        log = logger.warning if grace > 0 else logger.info
        log("killing what is left of the engine's processes: %s", ", ".join(str(p.pid) for p in left))
        for proc in left:
            try:
                proc.kill()
            except psutil.Error:
                pass
        left = await wait_gone(left, kill_timeout)
    await _stop_resource_tracker(kill_timeout)
    if left:
        logger.error("engine processes still alive after SIGKILL: %s", ", ".join(str(p.pid) for p in left))
    return left
