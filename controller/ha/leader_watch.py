"""A standby's fast path past the lease TTL when the leader's process is gone (docs/ha.md).

A standby holds a gRPC connection to the leader's advertised address (no call on it: the
connection is the signal). When that connection drops, it connects to the address once more
with a plain TCP connect. A refused connect (TCP RST: the host is up and nothing listens there)
is a confirmed death: the standby revokes the dead leader's lease by its id (any etcd client
may), which deletes the leader key, and the election campaigns at once instead of waiting for
the lease to expire. Safety does not depend on this guess: every leader write is fenced by the
leader key's create revision, and node managers refuse an older epoch.

A leader that resigned (SIGTERM: its lease revoked before its port closes) is not taken for dead
even when the refusal reaches this standby before the key's deletion does: etcd is asked first.

A leader that is paused (SIGSTOP), partitioned, or whose host vanished does not refuse
connections (the kernel still accepts on a stopped process's socket; a silent host times out),
so it still costs the full TTL, as does a leader this standby never managed to connect to (an
address that never answered is no evidence of anything).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from controller.ha.election import LeaderElection, LeaderInfo, Role
from controller.store.etcd_client import UNAVAILABLE_ERRORS

logger = logging.getLogger(__name__)

READY = grpc.ChannelConnectivity.READY
LOST = (grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.TRANSIENT_FAILURE)


async def refuses_connections(address: str, timeout: float) -> bool:
    """True only when a TCP connect to host:port is refused (nothing listens, the host is up)."""
    host, _, port = address.rpartition(":")
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError):  # unreachable, silent, unresolvable: not a confirmed death
        return False
    writer.close()
    return False


class LeaderDeathWatch:
    """While this controller stands by, watches its connection to the leader (see module doc)."""

    def __init__(
        self, election: LeaderElection, channel: Callable[[str], grpc.aio.Channel], probe_timeout: float = 0.5
    ):
        self.election = election
        self.channel = channel  # makes a channel to a controller's address (its TLS settings)
        self.probe_timeout = probe_timeout
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="leader-death-watch")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _watched(self) -> LeaderInfo | None:
        e = self.election
        return e.leader if e.role is Role.STANDBY and e.leader and e.leader.lease_id and e.leader.address else None

    async def _run(self) -> None:
        while True:
            await self.election.wait_for(lambda e: self._watched() is not None)
            leader = self._watched()
            assert leader is not None
            try:
                await self._watch(leader)
            except asyncio.CancelledError:
                raise
            except Exception:  # the TTL still replaces the leader: never stop watching over one error
                logger.exception("watching the leader %s failed", leader.address)
                await asyncio.sleep(self.election.renew_period)

    async def _watch(self, leader: LeaderInfo) -> None:
        """Until the leader changes: hold a connection; once it has been up, a refused reconnect
        revokes the leader's lease."""
        changed = asyncio.ensure_future(self.election.wait_for(lambda e: self._watched() != leader))
        channel = self.channel(leader.address)
        connected = False
        try:
            while not changed.done():
                state = channel.get_state(try_to_connect=True)
                if state is READY:
                    connected = True
                elif connected and state in LOST and await refuses_connections(leader.address, self.probe_timeout):
                    await self._revoke(leader)
                    return
                moved = asyncio.ensure_future(channel.wait_for_state_change(state))
                await asyncio.wait({moved, changed}, timeout=self.election.ttl, return_when=asyncio.FIRST_COMPLETED)
                moved.cancel()
        finally:
            changed.cancel()
            await channel.close()

    async def _revoke(self, leader: LeaderInfo) -> None:
        if self._watched() != leader or not await self._still_holds(leader):
            return
        why = f"the leader {leader.address} (epoch {leader.epoch}) refused connections: its lease was revoked"
        logger.warning("%s; campaigning without waiting for the lease to expire", why)
        self.election.vacancy_reason = why
        try:
            await self.election.client.revoke_lease(leader.lease_id)
        except UNAVAILABLE_ERRORS as exc:  # etcd unreachable: the lease expires on its own
            logger.info("could not revoke the lease of %s: %s", leader.address, exc)
        except Exception as exc:  # gone already (expired, resigned): nothing to do
            logger.debug("revoking the lease of %s: %s", leader.address, exc)

    async def _still_holds(self, leader: LeaderInfo) -> bool:
        """Whether etcd still has `leader` as the leader. A leader stopping gracefully revokes
        its lease before it closes its port, but on a loaded machine the key's deletion may
        reach this standby's election after the refused connect: the election then tells the
        resignation, not a death. Unreadable etcd: the revoke is tried (and fails alike)."""
        try:
            held = await self.election.client.get(self.election.leader_key)
        except UNAVAILABLE_ERRORS:
            return True
        return held is not None and held.lease == leader.lease_id
