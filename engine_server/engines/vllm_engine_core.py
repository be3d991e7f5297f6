"""The engine-core child process, set up for the engine server.

vLLM starts its engine core with `multiprocessing` (spawn) and target
`EngineCoreProc.run_engine_core`. `install()` points that target at `run_engine_core` below,
which runs in the child before vLLM's own entry point and:
  - moves the child into its own process group, so a Ctrl-C or a SIGTERM sent to the engine
    server's group reaches only the engine server, which then drains and stops the engine core
    in order (otherwise the core dies first and a graceful stop turns into an engine death);
  - exits the child as soon as the engine server is gone, even after a SIGKILL (vLLM does not
    watch its parent: an orphaned engine core would keep its memory, vLLM issue #55846);
  - sends the child's log records to stderr in the engine server's format;
  - installs the engine-core half of the probe filter (prefix-cache statistics).
"""

from __future__ import annotations

import logging
import os
import select
import sys
import threading

logger = logging.getLogger(__name__)

_ORIGINAL_ATTR = "_motor_original_run_engine_core"
LOG_LEVEL_ENV = "MOTOR_ENGINE_CORE_LOG_LEVEL"


def _original():
    from vllm.v1.engine.core import EngineCoreProc

    # In the parent the class attribute is this module's function; the original is kept aside.
    return getattr(EngineCoreProc, _ORIGINAL_ATTR, None) or EngineCoreProc.run_engine_core


def _exit_with_parent(parent_pid: int) -> None:
    """Exit this process when `parent_pid` exits (pidfd: no polling)."""
    try:
        pidfd = os.pidfd_open(parent_pid)
    except OSError:
        os._exit(1)  # already gone
    if os.getppid() != parent_pid:  # the parent died before the pidfd was opened
        os._exit(1)

    def watch() -> None:
        select.select([pidfd], [], [])
        # Nobody is left to read our output or stop us: leave at once, freeing the memory.
        os._exit(1)

    threading.Thread(target=watch, name="motor-parent-watch", daemon=True).start()


def run_engine_core(*args, **kwargs):
    """Replacement target of vLLM's engine-core process (see the module docstring)."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass  # e.g. already a group leader; the parent watch below still applies
    _exit_with_parent(os.getppid())
    from motor.service.logs import LOG_FORMAT

    logging.basicConfig(
        level=os.environ.get(LOG_LEVEL_ENV, "INFO"),
        format="[engine-core] " + LOG_FORMAT,
        stream=sys.stderr,
    )
    from engine_server.engines.vllm_probe_filter import install_engine_core_patches

    install_engine_core_patches()
    return _original()(*args, **kwargs)


def install() -> None:
    """Route vLLM's engine-core process entry through `run_engine_core` (idempotent)."""
    from vllm.v1.engine.core import EngineCoreProc

    from engine_server.engines.vllm_probe_filter import VllmPatchError, check_engine_core_patches

    current = EngineCoreProc.__dict__.get("run_engine_core")
    if current is None:
        raise VllmPatchError(
            "vllm.v1.engine.core.EngineCoreProc.run_engine_core is missing in the installed vLLM: "
            "the engine server cannot set up the engine-core process (it supports vLLM 0.32)"
        )
    check_engine_core_patches()
    if hasattr(EngineCoreProc, _ORIGINAL_ATTR):
        return
    # Spawn pickles the target by module and name: this module's function is importable there.
    setattr(EngineCoreProc, _ORIGINAL_ATTR, current.__func__ if isinstance(current, staticmethod) else current)
    EngineCoreProc.run_engine_core = staticmethod(run_engine_core)
