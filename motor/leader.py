"""Following the leading controller among several (docs/ha.md): node managers and motorctl are
given every controller's address; a standby refuses a mutating call with UNAVAILABLE and names
the leader in the trailing metadata `motor-leader`; an unreachable controller is skipped."""

from __future__ import annotations

import logging
from typing import Any

import grpc

logger = logging.getLogger(__name__)

LEADER_METADATA = "motor-leader"


def parse_addresses(value: str, setting: str) -> list[str]:
    """"h1:p1,h2:p2" -> ["h1:p1", "h2:p2"]; ValueError naming `setting` when one is not host:port."""
    addresses = [item.strip() for item in value.split(",") if item.strip()]
    if not addresses:
        raise ValueError(f"{setting}: give at least one host:port")
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"{setting}: {address!r} is not host:port with a port in 1-65535")
    return addresses


def leader_named_in(error: Any) -> str | None:
    """The leader's address a standby put in its refusal, if any (grpc.RpcError, sync or asyncio)."""
    try:
        metadata = error.trailing_metadata() or ()
    except Exception:
        return None
    for key, value in metadata:
        if key == LEADER_METADATA and value:
            return value.decode() if isinstance(value, bytes) else value
    return None


class ControllerAddresses:
    """Which controller to call: the one last known to lead, else the next in the list."""

    def __init__(self, addresses: list[str]):
        self.addresses = list(addresses)
        self.current = self.addresses[0]

    @property
    def several(self) -> bool:
        return len(self.addresses) > 1

    def after_failure(self, error: Any) -> bool:
        """Move on after a failed call: to the leader the refusal names, or (UNAVAILABLE without
        one: unreachable, or a standby during an election) to the next address. True when the
        address changed."""
        leader = leader_named_in(error)
        previous = self.current
        if leader:
            if leader not in self.addresses:
                self.addresses.append(leader)  # a controller added since we started
            self.current = leader
        elif self.several and getattr(error, "code", lambda: None)() == grpc.StatusCode.UNAVAILABLE:
            self.current = self.addresses[(self.addresses.index(self.current) + 1) % len(self.addresses)]
        if self.current != previous:
            logger.info("controller %s did not take the call; trying %s%s", previous, self.current,
                        " (named as the leader)" if leader else "")
        return self.current != previous
