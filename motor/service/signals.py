"""The stop signals every service obeys: SIGTERM, SIGINT and SIGHUP set an asyncio.Event.

SIGHUP is a stop like the others, not a silent death (its default action): a service run from a
terminal that closes, or by a supervisor that sends it, stops the same graceful way and says why.
Once one has arrived the service is stopping: later ones are ignored, also after its event loop
has closed (closing it puts back the default actions, which killed a service that was still
shutting down when signals came in quick succession).
"""

from __future__ import annotations

import asyncio
import logging
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

logger = logging.getLogger("motor.service.signals")


class StopEvent(asyncio.Event):
    """Set by the first stop signal; `signal_name` says which ("SIGTERM" until one came)."""

    signal_name = "SIGTERM"


def stop_event() -> StopEvent:
    """An event set by the first SIGTERM, SIGINT or SIGHUP (handlers installed on the running
    loop): install it first thing, so that a signal during start-up is a stop too."""
    stop = StopEvent()
    loop = asyncio.get_running_loop()

    def received(sig: signal.Signals) -> None:
        stop.signal_name = sig.name
        logger.info("%s received: stopping", sig.name)
        for other in STOP_SIGNALS:
            loop.remove_signal_handler(other)
            signal.signal(other, signal.SIG_IGN)
        stop.set()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, received, sig)
    return stop
