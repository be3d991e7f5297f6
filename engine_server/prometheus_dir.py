"""A private PROMETHEUS_MULTIPROC_DIR for this process, created when unset and removed at exit.

prometheus_client picks its value storage when it is first imported, so call
`ensure_private_multiproc_dir()` before anything imports prometheus_client (the CLI does it
first thing). vLLM then finds the variable set and uses the multiprocess registry, and the engine
server's own metrics land in the same directory, so one `/metrics` shows both. A directory the user
set is left alone (and not removed): the user owns it.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

ENV = "PROMETHEUS_MULTIPROC_DIR"
_created: str | None = None


def ensure_private_multiproc_dir() -> str:
    """Return the multiprocess directory, creating a private one when the variable is unset."""
    global _created
    existing = os.environ.get(ENV)
    if existing:
        os.makedirs(existing, exist_ok=True)
        return existing
    _created = tempfile.mkdtemp(prefix="motor-engine-server-prom-")
    os.environ[ENV] = _created
    atexit.register(remove_private_multiproc_dir)
    return _created


def remove_private_multiproc_dir() -> None:
    """Remove the directory if this process created it (idempotent)."""
    global _created
    if _created is None:
        return
    path, _created = _created, None
    shutil.rmtree(path, ignore_errors=True)
    if os.environ.get(ENV) == path:
        del os.environ[ENV]
    logger.debug("removed private %s %s", ENV, path)
