"""Client channels that a process keeps, following their TLS files: a rotated client certificate,
key or CA bundle is used without a restart.

A gRPC channel's credentials are fixed when it is made, and a connection checks certificates
only at its handshake. A node manager or controller that kept its channels presented (and
trusted) the files of its start for ever: once they expired or the CA changed, the next
reconnect failed (for a node manager's engine channels that meant failed status checks, then
healthy engines killed). `ReloadingChannel` asks the process's `TlsFileWatch` of its files
(motor/service/tls.py, the same rule servers use) before handing out its channel: when the files changed
and belong together it makes a new channel from them and hands out that one. Calls running on the old channel are not
cut: it takes no new calls and is closed once they end, or after RETIRE_GRACE seconds (a
long-lived stream then ends, and its owner opens it again on the new channel).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from motor.service.grpc_server import TlsFiles, aio_channel
from motor.service.tls import TlsFileWatch

logger = logging.getLogger(__name__)

# Seconds the calls on a replaced channel may still run (status checks, starts and stops have
# their own shorter deadlines; a stream older than this is reopened on the new channel).
RETIRE_GRACE = 60.0

StubT = TypeVar("StubT")


class RetiredChannels:
    """Channels replaced by one made with renewed TLS files: each takes no new calls and is closed
    once its calls end, or RETIRE_GRACE seconds later (a long-lived stream then ends, and its
    owner opens it again on the new channel)."""

    def __init__(self) -> None:
        self._closing: dict[asyncio.Task, grpc.aio.Channel] = {}

    def retire(self, old: grpc.aio.Channel, target: str) -> None:
        closing = asyncio.get_running_loop().create_task(old.close(RETIRE_GRACE), name=f"retire channel to {target}")
        self._closing[closing] = old
        closing.add_done_callback(lambda task: self._closing.pop(task, None))

    async def close(self) -> None:
        """Close them now, cancelling the calls still running there."""
        for task, old in list(self._closing.items()):
            task.cancel()
            await old.close()


class ReloadingChannel:
    """A channel to `target` (plaintext when `tls` is None) and the stubs made on it."""

    def __init__(
        self,
        target: str,
        tls: TlsFiles | None = None,
        server_name: str | None = None,
        options: dict[str, Any] | None = None,
    ):
        self.target, self.tls = target, tls
        self._make: Callable[..., grpc.aio.Channel] = lambda pems=None: aio_channel(
            target, tls, server_name=server_name, options=options, pems=pems
        )
        self._watch = TlsFileWatch.shared(tls.cert, tls.key, tls.ca) if tls else None
        self._made_at = self._watch.reloads if self._watch else 0  # the version of the files in use
        self._channel = self._make(self._watch.pems if self._watch else None)
        self._stubs: dict[type, Any] = {}
        self._retired = RetiredChannels()
        self.replaced = 0  # channels made again because the files changed

    @property
    def channel(self) -> grpc.aio.Channel:
        """The channel to call on now: made again first if the TLS files changed."""
        if self._watch is not None:
            self._watch.changed()  # the files read again if they changed, for every channel of the process
        if self._watch is not None and self._watch.reloads != self._made_at:
            self._made_at = self._watch.reloads
            old, self._channel = self._channel, self._make(self._watch.pems)
            self._stubs.clear()
            self.replaced += 1
            self._retired.retire(old, self.target)
            logger.info("TLS files changed: new calls to %s use a new channel with them", self.target)
        return self._channel

    def stub(self, stub_class: Callable[[grpc.aio.Channel], StubT]) -> StubT:
        """A `stub_class` on the current channel: the same object until the channel is replaced (so
        a caller can tell that its stream belongs to the old one)."""
        channel = self.channel
        stub = self._stubs.get(stub_class)
        if stub is None:
            stub = self._stubs[stub_class] = stub_class(channel)
        return stub

    async def close(self) -> None:
        """Close the channel and any replaced one still finishing its calls (cancelling them)."""
        await self._retired.close()
        await self._channel.close()
