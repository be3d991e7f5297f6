"""The one text that describes how a process ended (engine reasons, events, logs)."""

from __future__ import annotations

import signal as _signal


def signal_name(number: int) -> str:
    try:
        return _signal.Signals(number).name
    except ValueError:
        return "unknown"


def describe_exit(exit_code: int | None = None, signal: int | None = None) -> str:
    """'killed by signal 9 (SIGKILL)', 'exited with code 1', or 'exited (exit code unknown)'."""
    if signal is not None:
        return f"killed by signal {signal} ({signal_name(signal)})"
    if exit_code is not None:
        return f"exited with code {exit_code}"
    return "exited (exit code unknown)"


def describe_returncode(returncode: int | None) -> str:
    """The same text from a subprocess/multiprocessing return code (negative: the signal)."""
    if returncode is None:
        return describe_exit()
    if returncode < 0:
        return describe_exit(signal=-returncode)
    return describe_exit(exit_code=returncode)
