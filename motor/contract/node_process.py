"""Which node manager process holds a node id (motor.v1.NodeManagerProcess), read by both sides.

A node manager draws a new `nonce` at every start; `boot_id` and `state_dir_id` name the host's
boot and the state directory it runs on. Only one node manager runs on a state directory at a
time (it holds a lock on it), so a process with the same boot id and state directory id as the
holder is the holder restarted, never a second live copy.
"""

from __future__ import annotations

import datetime

from motor.v1 import types_pb2

Process = types_pb2.NodeManagerProcess


def known(process: Process) -> bool:
    """False for a registration from a node manager older than process identities."""
    return bool(process.nonce)


def same_process(a: Process, b: Process) -> bool:
    return known(a) and a.nonce == b.nonce


def same_seat(a: Process, b: Process) -> bool:
    """Same host boot and same state directory: `b` is `a` restarted (or `a` itself)."""
    return bool(a.boot_id and a.state_dir_id) and (a.boot_id, a.state_dir_id) == (b.boot_id, b.state_dir_id)


def utc(wall: float) -> str:
    return datetime.datetime.fromtimestamp(wall, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def describe(process: Process) -> str:
    """'pid 123 on host h, started 2026-11-22T20:01:02Z' (or 'an unidentified process')."""
    if not known(process):
        return "an unidentified process (a node manager without process identity)"
    started = f", started {utc(process.started_at.ToSeconds())}" if process.HasField("started_at") else ""
    return f"pid {process.pid} on host {process.hostname or '?'}{started}"
