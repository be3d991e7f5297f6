"""Who answered a request on this host: the process holding the server side of its TCP connection.

The engine server judges its engine by what answers on the inference port. Another process
listening there (another cluster's engine given the same port, one that binds with SO_REUSEPORT
beside this engine) answers `GET /health` 200 too: the engine server once declared its vLLM
engine NORMAL 24 s before vLLM's own HTTP server started (issue 61 #2). The server side of the
connection is a socket in /proc/net/tcp (local port: the server's, remote port: the client's);
this engine's answers come from a socket held by this process or one of its descendants (vLLM's
API server runs in-process, SGLang in a child).
"""

from __future__ import annotations

import contextlib
import os

import psutil

TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


LISTEN = "0A"  # the state column of a listening socket


def _tcp_sockets() -> list[tuple[int, int, str, int]]:
    """(local port, remote port, state, inode) of every TCP socket of this network namespace."""
    found = []
    for table in TCP_TABLES:
        with contextlib.suppress(OSError), open(table, encoding="ascii") as handle:
            next(handle, None)  # the header
            for line in handle:
                fields = line.split()
                local, remote = fields[1].rsplit(":", 1)[1], fields[2].rsplit(":", 1)[1]
                found.append((int(local, 16), int(remote, 16), fields[3], int(fields[9])))
    return found


def _answering_inodes(server_port: int, client_port: int) -> list[int]:
    """The socket that accepted the connection from `client_port`; once it is closed (a server
    that closes after answering), the sockets listening on the port, any of which may have."""
    sockets = _tcp_sockets()
    accepted = [inode for local, remote, _, inode in sockets if (local, remote) == (server_port, client_port)]
    if accepted and accepted[0]:
        return accepted[:1]
    return [inode for local, _, state, inode in sockets if local == server_port and state == LISTEN and inode]


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def _descendants() -> list[int]:
    with contextlib.suppress(psutil.Error):
        return [child.pid for child in psutil.Process().children(recursive=True)]
    return []


def _holder(inode: int) -> str:
    """Best effort, only once a stranger answered: which process holds the socket."""
    for pid in psutil.pids():
        if inode in _socket_inodes(pid):
            with contextlib.suppress(psutil.Error):
                return f"pid {pid} ({psutil.Process(pid).name()})"
            return f"pid {pid}"
    return "a process of another user"


def stranger(server_port: int, client_port: int) -> str:
    """'' when this process (or a descendant) answered the connection from `client_port` (or,
    that socket closed already, holds every listener of the port); else who did answer."""
    others = [
        inode for inode in _answering_inodes(server_port, client_port) if inode not in _socket_inodes(os.getpid())
    ]
    if others:  # vLLM's API server runs in this process, SGLang in a child: read those only now
        ours = set().union(*(_socket_inodes(pid) for pid in _descendants()))
        others = [inode for inode in others if inode not in ours]
    return _holder(others[0]) if others else ""
