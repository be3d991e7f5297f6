"""The stop signals every service obeys: SIGTERM, SIGINT and SIGHUP set an asyncio.Event.

SIGHUP is a stop like the others, not a silent death (its default action): a service run from a
terminal that closes, or by a supervisor that sends it, stops the same graceful way and says why.
"""

from __future__ import annotations

import asyncio
import logging
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

logger = logging.getLogger("motor.signals")


def stop_event() -> asyncio.Event:
    """An event set by the first SIGTERM, SIGINT or SIGHUP (handlers installed on the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def received(sig: signal.Signals) -> None:
        if not stop.is_set():
            logger.info("%s received: stopping", sig.name)
        stop.set()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, received, sig)
    return stop


async def wait_for_stop_signal() -> None:
    """Return once SIGTERM, SIGINT or SIGHUP arrives."""
    await stop_event().wait()
