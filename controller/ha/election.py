"""Leader election among controllers on etcd, the shape of etcd's `concurrency.Election` and
Kubernetes' `leaderelection`.

- Each controller holds a session: a lease it renews every `ttl / 3` seconds and a membership
  key bound to it (`motorctl controllers` lists them).
- A campaign is one transaction: if the leader key does not exist, create it bound to this
  controller's session lease and raise the epoch counter by one. The winner's epoch is larger than any
  earlier leader's; it travels on every command to node managers, which refuse older ones.
- The lease is renewed from a thread of its own (`_Renewal`), so a busy event loop does not
  cost the leadership; a loop that has not run for `max_stall` seconds stops the renewals.
- The leader counts itself leader only until
  `renew_deadline` after the last renewal it *sent* that succeeded (2/3 of the TTL by default):
  etcd keeps the lease at least TTL after that, so the leader stops acting before its lease
  can expire and another controller can win. A leader that was paused (SIGSTOP, a long GC)
  finds its deadline passed the moment it runs again and steps down without another call; a
  leader that steps down ends its session (revokes the lease), so no stale key outlives it.
- Every write the leader makes carries `fence()`: "the leader key still has my create
  revision". After the lease expired the key is gone or belongs to a newer leader, so the
  write is refused by etcd itself, whatever the deposed leader believes.
- Standbys watch the leader key and campaign as soon as it is deleted (lease expiry or
  resignation); they also re-read it every TTL in case a watch stalls.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aetcd

from controller.store.etcd_client import UNAVAILABLE_ERRORS
from motor.service.retry import RepeatedFailure
from motor.service.tasks import set_within

logger = logging.getLogger(__name__)

# A failed lease renewal is tried again after this share of the renewal period (0.11 s at the
# 2 s TTL): several tries fit before the leader's deadline while the client moves to another
# etcd member, and a failing etcd gets a few calls a second, not a busy loop.
RETRY_SHARE = 1 / 6


class Role(enum.Enum):
    CANDIDATE = "candidate"  # no leader known yet, or campaigning
    STANDBY = "standby"  # another controller leads
    LEADER = "leader"


@dataclass(frozen=True)
class LeaderInfo:
    """The leader as recorded in etcd (what `motorctl controllers` and redirects show)."""

    address: str  # host:port its gRPC server is reachable on
    epoch: int
    name: str = ""
    lease_id: int = 0
    create_revision: int = 0  # the fence: writes require the leader key at this revision

    def encode(self) -> bytes:
        return json.dumps({"address": self.address, "epoch": self.epoch, "name": self.name}).encode()

    @classmethod
    def decode(cls, kv: Any) -> LeaderInfo:
        data = json.loads(kv.value)
        return cls(data["address"], int(data["epoch"]), data.get("name", ""), kv.lease, kv.create_revision)


class NotLeader(Exception):
    """This controller may not write or act: it is not (or no longer) the leader."""


class LeaderElection:
    """Campaigns, renews and observes leadership; `is_leader()` and `fence()` are what the rest
    of the controller consults before acting or writing."""

    def __init__(
        self,
        client: aetcd.Client,
        prefix: str,
        address: str,
        *,
        renew_client: Callable[[], aetcd.Client],
        name: str = "",
        ttl: int = 2,
        renew_deadline_share: float = 2 / 3,
        clock: Callable[[], float] = time.monotonic,
        max_stall: float = 30.0,
    ):
        if ttl < 1:
            raise ValueError("the lease TTL is whole seconds, at least 1")
        self.client = client
        self.leader_key = f"{prefix}/election/leader".encode()
        self.epoch_key = f"{prefix}/election/epoch".encode()
        self.address = address
        self.name = name or address
        self.renew_deadline_share = renew_deadline_share
        # Makes the renewal thread's own client (a grpc.aio channel belongs to one event loop).
        self.renew_client = renew_client
        self.max_stall = max_stall
        self.loop_tick = clock()
        self._set_ttl(ttl)
        self.clock = clock
        self.role = Role.CANDIDATE
        self.leader: LeaderInfo | None = None  # as last seen in etcd (this controller when leading)
        self.reason = "starting"  # why the role last changed (for events and logs)
        self.members_prefix = f"{prefix}/election/members/".encode()
        self._lease: Any = None
        self._renewed_at = 0.0  # send time of the lease's last successful renewal (or grant)
        self._over = asyncio.Event()  # set when the current session must end
        self._watch_from = 0  # etcd revision after the last read of the leader key
        self._valid_until = 0.0
        self._listeners: list[Callable[[Role, LeaderInfo | None, str], None]] = []
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        # Why the leader key is about to be deleted, when this process knows (leader_watch.py).
        self.vacancy_reason = ""

    def _set_ttl(self, ttl: int) -> None:
        self.ttl = ttl
        self.renew_period = ttl / 3
        self.renew_deadline = ttl * self.renew_deadline_share

    # --- what the rest of the controller asks -------------------------------------------------

    def is_leader(self) -> bool:
        """True only while this controller leads and its renewal deadline has not passed."""
        return self.role is Role.LEADER and self.clock() < self._valid_until

    @property
    def epoch(self) -> int:
        return self.leader.epoch if self.role is Role.LEADER and self.leader else 0

    def fence(self) -> list[Any]:
        """The compare every leader write carries (raises NotLeader when not leading)."""
        if not self.is_leader():
            raise NotLeader(self.not_leader_message())
        assert self.leader is not None
        return [self.client.transactions.create(self.leader_key) == self.leader.create_revision]

    def not_leader_message(self) -> str:
        if self.leader and self.role is not Role.LEADER:
            return f"this controller is a standby; the leader is {self.leader.address} (epoch {self.leader.epoch})"
        return "no controller leads at the moment (election in progress); retry shortly"

    def on_change(self, listener: Callable[[Role, LeaderInfo | None, str], None]) -> None:
        """`listener(role, leader, reason)` runs on the event loop after every change of role or leader."""
        self._listeners.append(listener)

    async def wait_for(self, predicate: Callable[[LeaderElection], bool]) -> None:
        while not predicate(self):
            self._changed.clear()
            await self._changed.wait()

    def lost(self, reason: str) -> None:
        """Step down now (a fenced write, a missed renewal); the run loop campaigns again later."""
        if self.role is Role.LEADER:
            logger.warning("stepping down as leader (epoch %d): %s", self.epoch, reason)
            self._valid_until = 0.0
            self._set(Role.CANDIDATE, None, reason)
            self._over.set()  # end the session: its lease must not keep our leader key alive

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="leader-election")

    async def stop(self) -> None:
        """Resign (revoke the lease, so a standby takes over at once) and stop."""
        self._stopping = True
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._valid_until = 0.0
        if self.role is Role.LEADER:
            self._set(Role.CANDIDATE, None, "resigned: controller stopping")
        await self._revoke()

    async def controllers(self) -> tuple[list[tuple[str, str]], LeaderInfo | None]:
        """Every controller whose session is alive, as (address, name), and the leader."""
        members = await self.client.get_prefix(self.members_prefix)
        leader = await self.client.get(self.leader_key)
        listed = sorted((json.loads(kv.value)["address"], json.loads(kv.value)["name"]) for kv in members.kvs)
        return listed, LeaderInfo.decode(leader) if leader else None

    # --- the loop: one session (a lease kept alive) at a time ---------------------------------

    async def _run(self) -> None:
        async def session() -> bool:
            if self._stopping:
                return True
            await self._session()
            return False

        # Keep campaigning whatever one session hit.
        await self._retried(session, "for the election", "election session failed", any_error=True)

    async def _retried(
        self, attempt: Callable[[], Awaitable[bool]], during: str, failed: str = "", any_error: bool = False
    ) -> None:
        """`attempt()` again and again until it returns True. One that fails is tried again after
        renew_period, doubling up to the TTL (a standby retries at most a TTL after etcd is back);
        told at the 1st, 10th, 100th... failure. Only etcd being unavailable is retried, unless
        `any_error` (then told as `failed`, with the traceback)."""
        failures = RepeatedFailure(self.renew_period, self.ttl)
        while True:
            try:
                if await attempt():
                    return
                failures.recovered()
            except asyncio.CancelledError:
                raise
            except UNAVAILABLE_ERRORS as exc:
                if failures.failed(exc):
                    logger.info("etcd unavailable %s (%d time(s) in a row): %s", during, failures.count, exc)
                await asyncio.sleep(failures.delay())
            except Exception:
                if not any_error:
                    raise
                if failures.failed():
                    logger.exception("%s (%d time(s) in a row)", failed, failures.count)
                await asyncio.sleep(failures.delay())

    async def _session(self) -> None:
        """A lease for this controller, its membership key, and campaigns on that lease, until
        the lease is lost or leadership ends (a deposed leader starts a fresh session: its old
        lease must not keep a leader key alive)."""
        self._over = asyncio.Event()
        sent = self.clock()  # etcd starts the lease's TTL after this instant
        self._lease = await self.client.lease(self.ttl)
        self._renewed_at = sent
        if self._lease.ttl > self.ttl:  # etcd raises a TTL below its minimum (2 s by default)
            logger.warning("etcd granted a %ds lease instead of %ds", self._lease.ttl, self.ttl)
            self._set_ttl(self._lease.ttl)
        member = json.dumps({"address": self.address, "name": self.name}).encode()
        await self.client.put(self.members_prefix + self.address.encode(), member, lease=self._lease.id)
        campaigns = asyncio.get_running_loop().create_task(self._campaign_loop(), name="campaign")
        try:
            await self._keep_alive()
        finally:
            campaigns.cancel()
            await asyncio.gather(campaigns, return_exceptions=True)
        await self._revoke()  # not when cancelled: stop() resigns, a frozen test double must not

    async def _keep_alive(self) -> None:
        """Watch the session while a thread renews its lease; return when the session is over."""
        renewal = _Renewal(self, self._lease.id)
        renewal.start()
        try:
            while True:
                self.loop_tick = self.clock()  # the renewal thread's proof that this loop runs
                if await set_within(self._over, self.renew_period / 2):
                    return
                if renewal.gone.is_set():
                    self.lost("the lease expired in etcd")
                    return
                if self.role is Role.LEADER and not self.is_leader():  # no renewal within the deadline
                    self.lost(f"no renewal of the lease within {self.renew_deadline:.1f}s{renewal.trouble}")
                    return
                if self.clock() >= self._renewed_at + self.ttl:
                    return  # the lease is surely gone: a new session with a new lease
        finally:
            renewal.stop.set()

    def _renewed(self, sent: float) -> None:
        """From the renewal thread: the lease was renewed by a request sent at `sent`."""
        self._renewed_at = sent
        if self.role is Role.LEADER:
            self._valid_until = sent + self.renew_deadline

    async def _campaign_loop(self) -> None:
        async def campaign() -> bool:
            if self.role is Role.LEADER:
                await self._over.wait()
                return True
            if not await self._campaign():
                await self._wait_for_vacancy()
            return False

        await self._retried(campaign, "during the campaign")

    async def _campaign(self) -> bool:
        current = await self.client.get(self.leader_key)
        if current is not None:
            if current.lease == self._lease.id:  # ours, from a leadership this process gave up
                await self.client.delete(self.leader_key)
                return False
            self._observe(LeaderInfo.decode(current), "leader found")
            self._watch_from = current.header.revision + 1
            return False
        if self.role is Role.STANDBY:  # the key went while no watch saw it (a TTL's re-read): a vacancy all the same
            why, self.vacancy_reason = self.vacancy_reason, ""
            self._observe(None, why or "the leader's key was deleted (lease expired or resigned)")
        epoch_kv = await self.client.get(self.epoch_key)
        epoch = int(epoch_kv.value) if epoch_kv else 0
        tx = self.client.transactions
        mine = LeaderInfo(self.address, epoch + 1, self.name)
        won, responses = await self.client.transaction(
            compare=[
                tx.version(self.leader_key) == 0,
                tx.mod(self.epoch_key) == (epoch_kv.mod_revision if epoch_kv else 0),
            ],
            success=[
                tx.put(self.leader_key, mine.encode(), lease=self._lease.id),
                tx.put(self.epoch_key, str(epoch + 1).encode()),
                tx.get(self.leader_key),
            ],
            failure=[],
        )
        if not won:  # another controller moved first: look again
            self._watch_from = 0
            return False
        _, kv = responses[2][0]
        self._valid_until = self._renewed_at + self.renew_deadline
        why = f" after {self.reason}" if self.role is Role.CANDIDATE and self.reason != "starting" else ""
        self._set(Role.LEADER, LeaderInfo.decode(kv), f"elected (epoch {epoch + 1}){why}")
        logger.info(
            "leading as %s with epoch %d (lease %x, ttl %ds)", self.address, epoch + 1, self._lease.id, self.ttl
        )
        return True

    async def _wait_for_vacancy(self) -> None:
        """Block until the leader key is deleted (or a TTL passes: re-read it then)."""
        if not self._watch_from:
            return
        watch = await self.client.watch(self.leader_key, start_revision=self._watch_from)
        try:
            async with asyncio.timeout(self.ttl):
                async for event in watch:
                    if event.kind == "DELETE":
                        why, self.vacancy_reason = self.vacancy_reason, ""
                        self._observe(None, why or "the leader's key was deleted (lease expired or resigned)")
                        return
                    self._observe(LeaderInfo.decode(event.kv), "a new leader was elected")
        except TimeoutError:
            pass
        finally:
            await watch.cancel()

    async def _revoke(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                await lease.revoke()
            except Exception as exc:  # expired already, or etcd unreachable: it expires on its own
                logger.debug("lease revoke failed: %s", exc)

    # --- state changes ------------------------------------------------------------------------

    def _observe(self, leader: LeaderInfo | None, reason: str) -> None:
        role = Role.STANDBY if leader else Role.CANDIDATE
        if self.role is Role.LEADER:
            return
        if leader != self.leader or role is not self.role:
            self._set(role, leader, reason)

    def _set(self, role: Role, leader: LeaderInfo | None, reason: str) -> None:
        self.role, self.leader, self.reason = role, leader, reason
        self._changed.set()
        for listener in list(self._listeners):
            try:
                listener(role, leader, reason)
            except Exception:
                logger.exception("leadership listener failed")


class _Renewal(threading.Thread):
    """Renews one session's lease every renew_period from its own thread, event loop and etcd
    client, so that a controller whose loop is busy for a while (one reconcile pass placing
    thousands of engines) keeps its lease. It stops renewing when the controller's loop has not
    run for `max_stall` seconds: a hung process must not keep the leadership. A stopped process
    (SIGSTOP) stops this thread with it, so a paused leader still loses its lease."""

    def __init__(self, election: LeaderElection, lease_id: int):
        super().__init__(name="lease-renewal", daemon=True)
        self.election, self.lease_id = election, lease_id
        self.stop = threading.Event()
        self.gone = threading.Event()  # etcd says the lease no longer exists
        self.trouble = ""  # why the last renewal failed, for the step-down message

    def run(self) -> None:
        asyncio.run(self._renew())

    async def _renew(self) -> None:
        e = self.election
        client = e.renew_client()
        pause = e.renew_period
        try:
            while not self.stop.is_set():
                await asyncio.sleep(pause)
                if self.stop.is_set():
                    return
                stalled = e.clock() - e.loop_tick
                if stalled > e.max_stall:
                    self.trouble = f" (the controller's event loop has not run for {stalled:.0f}s)"
                    logger.error(
                        "no longer renewing the lease: the controller's event loop has not run for %.0fs", stalled
                    )
                    return
                sent = e.clock()
                expires = e._renewed_at + e.ttl
                try:
                    async with asyncio.timeout(max(expires - sent, 0.05)):
                        reply = await client.refresh_lease(self.lease_id)
                except (*UNAVAILABLE_ERRORS, TimeoutError) as exc:
                    # Again soon, not a period later: the channel may already be on another
                    # member, and a period's wait would leave one try before the deadline.
                    self.trouble = f" (etcd: {exc!r})"
                    pause = e.renew_period * RETRY_SHARE
                    continue
                pause = e.renew_period
                if reply is None or reply.TTL <= 0:
                    self.gone.set()
                    return
                if not self.stop.is_set():
                    self.trouble = ""
                    e._renewed(sent)
        finally:
            await client.close()
