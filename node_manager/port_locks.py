"""Ports reserved host-wide: one lock file per port under a directory every node manager of the
host shares (`--port-lock-dir`, default /tmp/motor-ports).

A port found free is not yet taken: vLLM binds its inference port only after loading its model,
tens of seconds later, and another node manager on the same host (another cluster's, or a second
node of `motorctl up`) with the same default range could hand the same port out meanwhile; its
engine then answered the first engine server's `GET /health` (issue 61 #2). So a node manager
takes a port only once it holds an exclusive `flock` on `<dir>/<port>.lock`, and keeps it until
the engine ends. The kernel drops the lock with the process that held it, so a node manager that
died leaves nothing stale; the new one takes its engines' ports again when it adopts them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat

logger = logging.getLogger(__name__)

DEFAULT_DIR = "/tmp/motor-ports"


class PortLocks:
    def __init__(self, directory: str = DEFAULT_DIR):
        self.directory = directory
        self._held: dict[int, int] = {}  # port -> the open lock file
        self._make_directory()

    def _make_directory(self) -> None:
        """A directory every user's node manager can add to, as /tmp is (sticky, world-writable)."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            if os.stat(self.directory).st_uid == os.getuid():
                os.chmod(self.directory, 0o1777)
        except OSError as exc:
            raise OSError(exc.errno, f"--port-lock-dir {self.directory}: {exc.strerror}") from None

    def take(self, port: int) -> bool:
        """Hold the port host-wide; False when another process (another node manager) holds it."""
        if port in self._held:
            return True
        fd = self._open(os.path.join(self.directory, f"{port}.lock"))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        self._held[port] = fd
        return True

    @staticmethod
    def _open(path: str) -> int:
        # Read-only suffices for flock, and lets a node manager of another user lock a file this
        # one made; O_CREAT only when it is missing (fs.protected_regular refuses O_CREAT on
        # another user's file in a sticky directory).
        for _ in range(3):
            with contextlib.suppress(FileNotFoundError):
                return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            with contextlib.suppress(FileExistsError):
                return os.open(
                    path,
                    os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                    stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH,
                )
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def give_back(self, port: int) -> None:
        fd = self._held.pop(port, None)
        if fd is not None:
            os.close(fd)  # closing drops the lock; the file stays for the next taker

    def close(self) -> None:
        for port in list(self._held):
            self.give_back(port)
