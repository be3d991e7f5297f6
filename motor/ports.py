"""Port checks and allocation (node managers, engine servers, the local cluster)."""

from __future__ import annotations

import collections
import random
import socket
from typing import Protocol

# Default /metrics ports (docs/observability.md); engine servers serve theirs on the inference port.
CONTROLLER_METRICS_PORT = 9471
NODE_MANAGER_METRICS_PORT = 9472


def port_is_free(port: int, host: str = "0.0.0.0") -> bool:
    """True when a TCP listener could bind `host:port` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _outside_ephemeral_range() -> range:
    """Ports no outgoing connection takes as its own: above the kernel's ephemeral range when
    there is room there, below it otherwise."""
    try:
        with open(EPHEMERAL_RANGE, encoding="ascii") as handle:
            low, high = (int(value) for value in handle.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(high + 1, 65536) if 65535 - high >= 1000 else range(max(1024, low - 10000), low)


# Ports free_port handed out lately: one picked for a listener not bound yet is still free, and
# picked again it gave a node manager's gRPC and /metrics listeners the same port (one exited).
_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=1000)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a listener started soon (racy by nature: bind it soon), and not one
    this process was handed lately. Picked outside the kernel's ephemeral range: a port the kernel
    picks (bind to port 0) is one it also gives outgoing connections as their local port, and one
    of those took an etcd member's port between the pick and the member's bind (it exited:
    address already in use)."""
    candidates = _outside_ephemeral_range()
    for _ in range(200):
        port = random.choice(candidates)
        if port not in _HANDED_OUT and port_is_free(port, host):
            _HANDED_OUT.append(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # that range is full: any free port
        sock.bind((host, 0))
        return sock.getsockname()[1]


class HostPorts(Protocol):
    """Ports held host-wide, across the processes that share the host (node_manager/port_locks.py)."""

    def take(self, port: int) -> bool: ...

    def give_back(self, port: int) -> None: ...


class PortAllocator:
    """Hands out free ports from [start, end], skipping ones in use or already handed out, here
    or (with `host_ports`) by another process of the host."""

    def __init__(self, start: int, end: int, host: str = "0.0.0.0", host_ports: HostPorts | None = None):
        if not 0 < start <= end <= 65535:
            raise ValueError(f"port range {start}-{end} is not within 1-65535")
        self.start, self.end, self.host = start, end, host
        self.host_ports = host_ports
        self.reserved: set[int] = set()
        self._next = start

    def reserve(self, port: int) -> bool:
        """Take a port given (by a request, an adopted engine); False when another process holds it."""
        if self.host_ports is not None and not self.host_ports.take(port):
            return False
        self.reserved.add(port)
        return True

    def release(self, port: int) -> None:
        self.reserved.discard(port)
        if self.host_ports is not None:
            self.host_ports.give_back(port)

    def _take(self, port: int) -> bool:
        return self.host_ports is None or self.host_ports.take(port)

    def allocate(self) -> int:
        span = self.end - self.start + 1
        for offset in range(span):
            port = self.start + (self._next - self.start + offset) % span
            if port not in self.reserved and port_is_free(port, self.host) and self._take(port):
                self.reserved.add(port)
                self._next = port + 1 if port < self.end else self.start
                return port
        raise RuntimeError(f"no free port left in {self.start}-{self.end}")
