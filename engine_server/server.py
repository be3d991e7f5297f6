"""The engine server's behaviour, without gRPC: status, probing, watchers, drain, sleep, death.

`EngineServer` wraps one EngineBackend. The gRPC servicer (service.py) and the CLI (cli.py) only
translate to and from it, so tests drive it directly as well as through real processes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_server.descendants import CLEAN_EXIT_GRACE_S
from engine_server.engines.base import EngineBackend, EngineOptions, UtilizationSampler
from engine_server.load_meter import SAMPLE_PERIOD, InFlightMeter
from engine_server.probing import (
    HealthClient,
    HttpHealthClient,
    HttpProbeClient,
    PeakSampler,
    ProbeClient,
    ProbeFailed,
    Prober,
    ProbeRecord,
)  # fmt: skip
from engine_server.samplers import choose_sampler
from engine_server.serving import CHECK_PERIOD, RecoveryProbes, ServingChange, ServingWatchdog
from engine_server.status import Event, Health, HealthStateMachine, Transition
from motor.clock import SYSTEM_CLOCK, Clock
from motor.contract.user_config import EngineSection
from motor.errors import FailedPrecondition, InvalidArgument
from motor.service.fanout import FanOut, Subscription

logger = logging.getLogger(__name__)

# WatchProbes messages queued for one client before its stream is cut (RESOURCE_EXHAUSTED).
WATCH_QUEUE_LIMIT = 1000


def connect_host(host: str) -> str:
    """Where to reach a server bound to `host` from this machine (wildcards -> loopback)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host in ("::", "[::]"):
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


@dataclass(frozen=True)
class StatusSnapshot:
    health: Health
    reason: str
    engine_type: str
    role: str
    instance_id: str
    dp_rank: int
    sleeping: bool
    draining: bool
    probing: bool
    consecutive_failures: int
    probe_interval: float
    last_probe: ProbeRecord | None
    in_flight_requests: int
    in_flight_average: float  # over the last second (load_meter.py): the autoscaler's signal
    stop_grace: float  # seconds a SIGTERM needs to end in exit: drain_timeout + shutdown
    not_serving_reason: str = ""  # the stall watchdog's verdict: '' while serving


@dataclass(frozen=True)
class WatchEvent:
    """One WatchProbes message: the status, and the probe that caused it (if any)."""

    status: StatusSnapshot
    probe: ProbeRecord | None = None


class EngineServer:
    def __init__(
        self,
        options: EngineOptions,
        section: EngineSection,
        engine: EngineBackend,
        metrics: Any = None,
        sampler: UtilizationSampler | None = None,
        probe_client: ProbeClient | None = None,
        health_client: HealthClient | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ):
        self.options, self.section, self.engine, self.metrics, self.clock = options, section, engine, metrics, clock
        self.settings = section.health_check_config
        self.base_url = f"http://{connect_host(options.host)}:{options.port}"
        self.machine = HealthStateMachine(clock)
        self.machine.on_transition(self._on_transition)
        self._sampler = sampler
        self._probe_client = probe_client or HttpProbeClient(self.base_url, options.role, self.settings.probe_timeout)
        self._health_client = health_client or HttpHealthClient(self.base_url, self.settings.health_collector_timeout)
        self.prober: Prober | None = None
        # The stall watchdog: on for every engine, whatever enable_virtual_inference says.
        self.watchdog = ServingWatchdog(
            self.settings, engine, self.machine, self._on_serving_change, metrics=metrics, clock=clock
        )
        self.load = InFlightMeter()
        self._recovery_task: asyncio.Task | None = None
        # GET /health every probe_interval while nothing probes (a probe round checks it first).
        self._health_task: asyncio.Task | None = None
        self._closing = False
        self.sleeping = False
        self.draining = False
        self.healthy = False
        self.died = asyncio.Event()
        self.death_reason = ""
        self._probing_requested = False
        self._probe_task: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []
        self._watchers: FanOut[WatchEvent] = FanOut("WatchProbes", WATCH_QUEUE_LIMIT)
        if metrics is not None:
            metrics.status.set(int(self.machine.state))

    # --- life cycle ------------------------------------------------------------------------
    @property
    def stop_grace(self) -> float:
        """How long SIGTERM may take to end this process: the drain, the engine's shutdown, and
        the wait for its processes. The node manager waits at least this long before SIGKILL."""
        return self.section.drain_timeout + self.engine.shutdown_grace + CLEAN_EXIT_GRACE_S

    async def check_config(self, check: Callable[[], Any]) -> Any:
        """Run the engine's configuration check off the loop (vLLM: imports vLLM and reads the
        model's config, seconds) while the management plane answers INIT with why."""
        self.machine.fire(
            Event.STARTING, f"starting: checking the configuration ({self.engine.engine_type} engine_args)"
        )
        result = await asyncio.to_thread(check)
        self.machine.fire(Event.STARTING, "starting: waiting for the inference plane's GET /health to answer")
        return result

    async def start(self) -> None:
        """Start the engine, then watch /health (INIT -> NORMAL) and the engine's death."""
        await self.engine.start()
        sampler = self._sampler or choose_sampler(self.engine)
        logger.info("utilization sampler: %s", sampler.name)
        self.prober = Prober(
            self.settings,
            self._probe_client,
            PeakSampler(sampler, self.settings.utilization_window, self.settings.utilization_sample_period, self.clock),
            self.machine,
            on_record=self._on_probe,
            metrics=self.metrics,
            progress=self.engine.progress,
            health=self._health_client,
            on_health_check=self._publish,
            clock=self.clock,
        )
        self._tasks.append(asyncio.create_task(self._watch_death(), name="watch-death"))
        self._tasks.append(asyncio.create_task(self._watch_health(), name="watch-health"))

    async def _watch_health(self) -> None:
        """Until the first 200 (INIT -> NORMAL); then /health is checked for the engine's whole
        life, by each probe round or, while nothing probes, by the health-check loop."""
        last_problem = None
        while True:
            try:
                await self._health_client.check()
                break
            except ProbeFailed as exc:
                problem = str(exc)
            if problem != last_problem:
                logger.info("engine not up yet: %s", problem)
                last_problem = problem
            await self.clock.sleep(self.settings.health_poll_interval)
        self.healthy = True
        self.machine.fire(Event.HEALTH_UP, "inference plane is up: GET /health answered 200")
        self._maybe_start_probing()
        self._resume_health_checks()
        self._tasks.append(asyncio.create_task(self._watch_serving(), name="stall-watchdog"))
        self._tasks.append(asyncio.create_task(self._meter_load(), name="load-meter"))

    async def _meter_load(self) -> None:
        """Read the engine's requests in flight every SAMPLE_PERIOD into the load meter."""
        failing = False
        while not (self.machine.dead or self._closing):
            try:
                self.load.add(self.clock.monotonic(), self.engine.in_flight_requests())
                failing = False
            except Exception:  # an engine's counters must not stop the meter; said once, not 20 times a second
                if not failing:
                    logger.exception("reading the requests in flight failed")
                failing = True
            await self.clock.sleep(SAMPLE_PERIOD)

    # --- the stall watchdog ----------------------------------------------------------------
    async def _watch_serving(self) -> None:
        """Read the engine's requests in flight and progress every CHECK_PERIOD (not while it
        sleeps: nothing runs then)."""
        while not (self.machine.dead or self._closing):
            if not self.sleeping:
                try:
                    self.watchdog.check()
                except Exception:  # an engine's counters must not stop the watchdog
                    logger.exception("stall watchdog check failed")
            await self.clock.sleep(CHECK_PERIOD)

    def _on_serving_change(self, change: ServingChange) -> None:
        # Before the routers hear of it: the requests the engine holds go back to the router
        # (503, retried elsewhere) now, instead of waiting for its kill.
        if self.watchdog.serving:
            self.engine.serve_again()
        else:
            self.engine.stop_serving(change.reason)
        self._publish()
        if not self.watchdog.serving and self._recovery_task is None and not self._closing:
            self._recovery_task = asyncio.create_task(self._recovery_probes(), name="recovery-probes")
            self._tasks.append(self._recovery_task)

    async def _recovery_probes(self) -> None:
        """While not serving, recovery probes (serving.RecoveryProbes): an engine whose clients
        gave up (nothing in flight to show progress) or that no longer gets requests (out of the
        routers) comes back as soon as it answers one."""
        try:
            await RecoveryProbes(
                self.settings, self._probe_client, self.watchdog, self.clock,
                paused=lambda: self.draining or self.sleeping,
                stopped=lambda: self.machine.dead or self._closing,
            ).run()  # fmt: skip
        finally:
            if self._recovery_task is asyncio.current_task():
                self._recovery_task = None

    def _resume_health_checks(self) -> None:
        """Check /health on its own while nothing probes (not while draining: the engine is going)."""
        if self._health_task is not None or self.probing or self.prober is None or not self.healthy:
            return
        if self.draining or self._closing or self.machine.dead:
            return
        self._health_task = asyncio.create_task(self.prober.run_health_checks(), name="health-checks")

    def _pause_health_checks(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            self._health_task = None

    async def _watch_death(self) -> None:
        reason = await self.engine.wait_dead()
        self.death_reason = reason
        self._stop_probing()
        self._pause_health_checks()
        self.machine.fire(Event.ENGINE_DIED, f"the engine died: {reason}")
        self.died.set()

    async def shutdown(self) -> tuple[bool, int]:
        """SIGTERM: stop probing, drain up to drain_timeout, shut the engine down; returns the
        drain's outcome (drained, requests left)."""
        drained, left = await self.drain(None)
        if not drained:
            logger.warning("drain deadline (%gs) passed with %d requests in flight", self.section.drain_timeout, left)
        await self.close(engine_timeout=None)
        return drained, left

    async def close(self, engine_timeout: float | None) -> None:
        """Stop background work, the engine (bounded by engine_timeout when given) and the watchers."""
        self._closing = True  # nothing resumes the health checks from here on
        self._stop_probing()
        self._pause_health_checks()
        for task in self._tasks:
            task.cancel()
        try:
            async with asyncio.timeout(engine_timeout):
                await self.engine.shutdown()
        except TimeoutError:
            logger.warning("engine shutdown did not finish within %gs", engine_timeout)
        except Exception:
            logger.exception("engine shutdown failed")
        for client in (self._probe_client, self._health_client):
            close = getattr(client, "close", None)
            if close is not None:
                await close()
        self._watchers.close()

    # --- probing ---------------------------------------------------------------------------
    @property
    def probing(self) -> bool:
        return self._probe_task is not None

    def _maybe_start_probing(self) -> None:
        if not (self._probing_requested and self.settings.probing and self.healthy):
            return
        if self.sleeping or self.draining or self.machine.dead or self.probing or self.prober is None:
            return
        logger.info(
            "virtual inference started (interval %gs, busy %gs, threshold %g%%)",
            self.prober.interval,
            self.settings.busy_probe_interval,
            self.settings.npu_usage_threshold,
        )
        self._pause_health_checks()  # each probe round checks /health first
        self._probe_task = asyncio.create_task(self.prober.run(), name="prober")
        self._probe_task.add_done_callback(self._probe_task_done)
        self._publish()

    def _probe_task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("probing stopped on an error", exc_info=task.exception())

    def _stop_probing(self) -> None:
        if self._probe_task is None:
            return
        self._probe_task.cancel()
        self._probe_task = None
        logger.info("virtual inference paused")
        self._resume_health_checks()

    def _on_probe(self, record: ProbeRecord) -> None:
        self._publish(record)

    def _on_transition(self, transition: Transition) -> None:
        if self.metrics is not None:
            self.metrics.status.set(int(transition.after))
        if transition.event not in (Event.FAILURE_LIMIT, Event.PROBE_SUCCEEDED, Event.HEALTH_RECOVERED):
            # Check-caused changes are published once: with the probe (_on_probe), or after the
            # /health check that caused them (Prober.on_health_check).
            self._publish()

    # --- status and watchers ---------------------------------------------------------------
    def status(self) -> StatusSnapshot:
        prober, in_flight = self.prober, self.engine.in_flight_requests()
        return StatusSnapshot(
            health=self.machine.state,
            reason=self.machine.reason,
            engine_type=self.engine.engine_type,
            role=self.options.role,
            instance_id=self.options.instance_id,
            dp_rank=self.options.dp_rank,
            sleeping=self.sleeping,
            draining=self.draining,
            probing=self.probing,
            consecutive_failures=prober.consecutive_failures if prober else 0,
            not_serving_reason=self.watchdog.not_serving_reason,
            probe_interval=prober.interval if prober else self.settings.probe_interval,
            last_probe=prober.last if prober else None,
            in_flight_requests=in_flight,
            in_flight_average=self.load.average(self.clock.monotonic(), in_flight),
            stop_grace=self.stop_grace,
        )

    def get_status(self) -> StatusSnapshot:
        """GetStatus: the first call arms virtual inference (the node manager's first heartbeat)."""
        if not self._probing_requested:
            self._probing_requested = True
            self._maybe_start_probing()
        return self.status()

    def subscribe(self) -> Subscription[WatchEvent]:
        """WatchEvents starting with the current status; it ends when the server closes."""
        return self._watchers.subscribe([WatchEvent(self.status())])

    def _publish(self, probe: ProbeRecord | None = None) -> None:
        self._watchers.publish(WatchEvent(self.status(), probe))

    # --- Drain / Sleep / WakeUp ------------------------------------------------------------
    async def drain(self, deadline: float | None) -> tuple[bool, int]:
        """Refuse new requests, stop probing, and wait for in-flight requests up to `deadline`
        seconds (None: drain_timeout)."""
        if deadline is None:
            deadline = self.section.drain_timeout
        if deadline < 0:
            raise InvalidArgument(f"deadline must not be negative (got {deadline:g}s)")
        if not self.draining:
            self.draining = True
            self.engine.stop_admitting()
            self._stop_probing()
            self._pause_health_checks()
            logger.info("draining: probes stopped, %d requests in flight", self.engine.in_flight_requests())
            self._publish()
        end = self.clock.monotonic() + deadline
        while self.engine.in_flight_requests() > 0 and self.clock.monotonic() < end:
            await self.clock.sleep(0.05)
        left = self.engine.in_flight_requests()
        return left == 0, left

    async def sleep(self, level: int) -> StatusSnapshot:
        level = level or 1
        if level not in (1, 2):
            raise InvalidArgument(f"level must be 1 (offload weights) or 2 (discard weights), got {level}")
        self._check_can_sleep()
        if not self.sleeping:
            self._stop_probing()
            await self.engine.sleep(level)
            self.sleeping = True
            logger.info("engine sleeps (level %d)", level)
            self._publish()
        return self.status()

    async def wake_up(self) -> StatusSnapshot:
        self._check_can_sleep()
        if self.sleeping:
            await self.engine.wake_up()
            self.sleeping = False
            logger.info("engine woke up")
            self._maybe_start_probing()
            self._publish()
        return self.status()

    def _check_can_sleep(self) -> None:
        if not self.engine.can_sleep:
            raise FailedPrecondition(f"engine type {self.engine.engine_type!r} cannot sleep")
        if self.machine.dead:
            raise FailedPrecondition(f"the engine died ({self.death_reason}); it can neither sleep nor wake up")
