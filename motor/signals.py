"""The stop signals every service obeys: SIGTERM and SIGINT set an asyncio.Event."""

from __future__ import annotations

import asyncio
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_event() -> asyncio.Event:
    """An event set by the first SIGTERM or SIGINT (handlers installed on the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    return stop


async def wait_for_stop_signal() -> None:
    """Return once SIGTERM or SIGINT arrives."""
    await stop_event().wait()
