"""This node manager's process identity and its hold on the state directory.

- `StateDirLock`: an exclusive `flock` on `<state-dir>/node_manager.lock`, held for the life of
  the process (the kernel drops it when the process dies, kill -9 included). A second node
  manager on the same state directory stops at start-up with a message naming the holder's pid:
  two processes re-adopting the same engines would supervise each one twice.
- `process_identity`: boot id + the state directory's id (`<state-dir>/node_manager.id`, drawn
  once) + a nonce drawn at every start. The controller compares them (motor/contract/node_process.py).
"""

from __future__ import annotations

import fcntl
import os
import socket
import uuid

from motor.contract import pbtime
from motor.errors import ConfigError
from motor.v1 import types_pb2
from node_manager.engine import atomic_write

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return ""  # not Linux: the state directory id and the nonce still tell processes apart


def state_dir_id(state_dir: str) -> str:
    """The state directory's own id, drawn at its first use and kept in it."""
    path = os.path.join(state_dir, "node_manager.id")
    try:
        with open(path, encoding="ascii") as handle:
            value = handle.read().strip()
        if value:
            return value
    except FileNotFoundError:
        pass
    value = uuid.uuid4().hex
    atomic_write(path, value + "\n")
    return value


def process_identity(state_dir: str, started_wall: float) -> types_pb2.NodeManagerProcess:
    return types_pb2.NodeManagerProcess(
        boot_id=boot_id(),
        state_dir_id=state_dir_id(state_dir),
        nonce=uuid.uuid4().hex,
        pid=os.getpid(),
        hostname=socket.gethostname(),
        started_at=pbtime.timestamp(started_wall),
    )


class StateDirLock:
    """Held from `acquire()` to `release()` (or the process's death)."""

    def __init__(self, state_dir: str):
        self.path = os.path.join(state_dir, "node_manager.lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                f"state_dir: {os.path.dirname(self.path)} is in use by another node manager (pid {holder}, "
                f"lock {self.path}); stop it first, or give this one another --state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None
