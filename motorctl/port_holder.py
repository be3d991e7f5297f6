"""Who listens on a TCP port of this machine: so `motorctl up` can name what holds a port it
wanted, and make sure the controller answering on its port is the one it started (a health check
answered by another cluster's controller passes just as well)."""

from __future__ import annotations

import psutil


def listening_pids(port: int) -> set[int]:
    """The processes with a listening socket on `port` (any address) that this user may see."""
    return {
        conn.pid
        for conn in psutil.net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid
    }


def describe_holder(port: int) -> str:
    """What listens on `port`, in words: 'pid 123 (motor-controller --listen ...)'."""
    pids = sorted(listening_pids(port))
    if not pids:
        return "a process this user cannot see (another user's, or a container's)"
    described = []
    for pid in pids[:3]:
        try:
            command = " ".join(psutil.Process(pid).cmdline()) or "?"
        except psutil.Error:  # gone meanwhile, or another user's
            command = "?"
        described.append(f"pid {pid} ({' '.join(command.split())[:120]})")
    return ", ".join(described)
