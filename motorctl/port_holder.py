"""Who listens on a TCP port of this machine (Linux /proc): so `motorctl up` can name what holds a
port it wanted, and make sure the controller answering on its port is the one it started (a
health check answered by another cluster's controller passes just as well)."""

from __future__ import annotations

import os

LISTEN = "0A"  # the TCP state LISTEN in /proc/net/tcp


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as handle:
                rows = handle.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def listening_pids(port: int) -> set[int]:
    """The processes with a listening socket on `port` (any address) that this user may see."""
    sockets = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    pids: set[int] = set()
    if not sockets:
        return pids
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
            if any(os.readlink(f"/proc/{entry}/fd/{fd}") in sockets for fd in fds):
                pids.add(int(entry))
        except OSError:  # gone meanwhile, or another user's
            continue
    return pids


def describe_holder(port: int) -> str:
    """What listens on `port`, in words: 'pid 123 (motor-controller --listen ...)'."""
    pids = sorted(listening_pids(port))
    if not pids:
        return "a process this user cannot see (another user's, or a container's)"
    described = []
    for pid in pids[:3]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = " ".join(part.decode(errors="replace") for part in handle.read().split(b"\0") if part)
        except OSError:
            command = "?"
        described.append(f"pid {pid} ({' '.join(command.split())[:120]})")
    return ", ".join(described)
