"""Virtual inference: 1-token probes, the utilization peak that chooses the next interval, and
the failure count that turns the status ABNORMAL.

Plain classes with injectable clock (`motor/clock.py`), sampler and probe client, so tests drive them fast.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from engine_server import answerer
from engine_server.engines.base import UtilizationSampler, probe_request_id
from engine_server.status import Event, Health, HealthStateMachine
from motor.clock import SYSTEM_CLOCK, Clock
from motor.contract.user_config import HealthCheckConfig
from motor.engine_key import authorization, engine_key

logger = logging.getLogger(__name__)

PROBE_BODY = {"prompt": "1", "max_tokens": 1}
# Sent by decode engines so that the probe does not wait for a KV cache from a prefill engine:
# do_virtual marks the probe, and the remote-prefill fields say "no remote KV" (NixlConnector names).
DECODE_KV_TRANSFER_PARAMS = {
    "do_virtual": True,
    "do_remote_prefill": False,
    "do_remote_decode": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


# Why a failed probe did not count, by whether the engine made progress (None: no progress source).
_BUSY_BECAUSE = {None: "accelerator busy", True: "engine busy and making progress"}


class ProbeFailed(Exception):
    """The probe did not produce a completion; the message says why."""


class ProbeClient(Protocol):
    async def probe(self) -> None:
        """Send one probe; raise ProbeFailed on any failure (HTTP error, timeout, bad answer)."""


@dataclass(frozen=True)
class ProbeRecord:
    time: float  # epoch seconds when sent
    success: bool
    latency: float
    error: str
    utilization_peak: float
    next_interval: float
    consecutive_failures: int
    counted: bool
    status: Health


def probe_request(role: str, now: float | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """(JSON body, headers) of one probe for `role`."""
    body: dict[str, Any] = dict(PROBE_BODY)
    if role == "decode":
        body["kv_transfer_params"] = dict(DECODE_KV_TRANSFER_PARAMS)
    stamp = int((now if now is not None else time.time()) * 1000)
    return body, {"X-Request-Id": probe_request_id(stamp)}


class HttpSession:
    """One HTTP session per client, opened by its first request and closed by close(); it carries
    the engines' key (motor/engine_key.py): the probes and /v1/models ask for it."""

    _session: aiohttp.ClientSession | None = None

    def session(self, timeout: aiohttp.ClientTimeout | None = None) -> aiohttp.ClientSession:
        if self._session is None:
            # timeout None: aiohttp's default
            self._session = aiohttp.ClientSession(timeout=timeout, headers=authorization(engine_key()))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class HttpProbeClient(HttpSession):
    """POST /v1/completions on the inference plane."""

    def __init__(self, base_url: str, role: str, timeout: float):
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.role, self.timeout = role, timeout

    async def probe(self) -> None:
        body, headers = probe_request(self.role)
        try:
            async with self.session().post(
                self.url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=self.timeout)
            ) as response:
                text = await response.text()
                if response.status != 200:
                    raise ProbeFailed(f"HTTP {response.status}: {text[:200]}")
                try:
                    answer = await response.json(content_type=None)
                except ValueError:
                    raise ProbeFailed(f"answer is not JSON: {text[:200]}") from None
                if not isinstance(answer, dict) or not answer.get("choices"):
                    raise ProbeFailed(f"answer has no choices: {text[:200]}")
        except TimeoutError:
            raise ProbeFailed(f"timed out after {self.timeout:g}s") from None
        except aiohttp.ClientError as exc:
            raise ProbeFailed(f"{type(exc).__name__}: {exc}") from None


class HealthClient(Protocol):
    async def check(self) -> None:
        """GET /health once; raise ProbeFailed saying what went wrong."""


class HttpHealthClient:
    """GET /health on the inference plane, each try bounded by `timeout` (health_collector_timeout),
    on a connection of its own: a 200 counts only when this engine server's own process (or a
    descendant) answered it, not another process listening on the same port (answerer.py)."""

    def __init__(self, base_url: str, timeout: float, stranger: Callable[[int, int], str] = answerer.stranger):
        self.url = base_url.rstrip("/") + "/health"
        address = urllib.parse.urlsplit(base_url)
        self.host, self.port = address.hostname or "127.0.0.1", address.port or 80
        self.timeout, self.stranger = timeout, stranger

    async def close(self) -> None:
        """Nothing is held between checks: each has a connection of its own."""

    async def check(self) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                reader, writer = await asyncio.open_connection(self.host, self.port)
                try:
                    # Kept alive until judged: the server's socket stays listed with its owner.
                    writer.write(f"GET /health HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n\r\n".encode())
                    status = _status(await reader.readline())
                    if status != 200:
                        raise ProbeFailed(f"GET /health answered {status}")
                    who = self.stranger(self.port, writer.get_extra_info("sockname")[1])
                finally:
                    writer.close()
        except TimeoutError:
            raise ProbeFailed(f"GET /health timed out after {self.timeout:g}s") from None
        except OSError as exc:
            # The address too: a refusal alone does not say where it could not connect.
            why = f" ({os.strerror(exc.errno)})" if exc.errno else ""
            raise ProbeFailed(f"GET /health failed: {type(exc).__name__} at {self.host}:{self.port}{why}") from None
        if who:
            raise ProbeFailed(
                f"GET /health on port {self.port} was answered by another process ({who}), not this engine"
            )


def _status(line: bytes) -> int | str:
    """The status code of an HTTP status line, or the line itself when it is not one."""
    parts = line.split()
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit():
        return int(parts[1])
    return repr(line[:80].decode(errors="replace")) if line else "nothing (connection closed)"


class PeakSampler:
    """Samples utilization every `period` over `window` seconds and returns the peak."""

    def __init__(
        self,
        sampler: UtilizationSampler,
        window: float,
        period: float,
        clock: Clock = SYSTEM_CLOCK,
    ):
        self.sampler, self.window, self.period, self._clock = sampler, window, period, clock
        self._warned = False

    async def peak(self) -> float:
        count = max(1, round(self.window / self.period))
        samples: list[float] = []
        for index in range(count):
            try:
                samples.append(float(await self.sampler.sample()))
            except Exception as exc:
                if not self._warned:  # once: a broken sampler would flood the log
                    logger.warning("utilization sampler %s failed: %s (counting as 0%%)", self.sampler.name, exc)
                    self._warned = True
            if index < count - 1:
                await self._clock.sleep(self.period)
        return max(samples, default=0.0)


@dataclass(eq=False)
class Prober:
    """Runs probe rounds; each round probes and samples utilization at the same time.

    Interval rule: peak >= busy_utilization -> busy_probe_interval, but only while the engine makes
    progress (or has no progress source): high utilization without progress is a hung kernel, not
    a busy engine, so it is probed at probe_interval; peak < npu_usage_threshold -> probe_interval;
    in between -> unchanged. A failure is not counted only while the engine is
    busy: the peak at or above npu_usage_threshold *and* the engine made progress (`progress`:
    tokens or scheduler steps for client requests) since the previous round. A hung kernel
    reads near 100 % on NVML and npu-smi, so utilization alone never excuses a failure; an
    engine without a progress source (`progress` returns None) is judged by utilization alone.
    max_failure_count consecutive counted failures -> ABNORMAL; a success resets the count (and
    an ABNORMAL status goes back to NORMAL)."""

    settings: HealthCheckConfig
    client: ProbeClient
    peak_sampler: PeakSampler
    machine: HealthStateMachine
    on_record: Callable[[ProbeRecord], None] = lambda record: None
    metrics: Any = None
    clock: Clock = SYSTEM_CLOCK
    progress: Callable[[], int | None] = lambda: None
    health: HealthClient | None = None
    on_health_check: Callable[[], None] = lambda: None

    def __post_init__(self) -> None:
        self._progress_seen: int | None = None  # the progress reading at the end of the previous round
        self.health_failing = False  # the last counted failure was a failed GET /health
        self.interval = self.settings.probe_interval
        self.consecutive_failures = 0
        self.last: ProbeRecord | None = None
        if self.metrics is not None:
            self.metrics.probe_interval.set(self.interval)

    def next_interval(self, peak: float, progressed: bool | None = None) -> float:
        if progressed is False and peak >= self.settings.npu_usage_threshold:
            return self.settings.probe_interval
        if peak >= self.settings.busy_utilization:
            return self.settings.busy_probe_interval
        if peak < self.settings.npu_usage_threshold:
            return self.settings.probe_interval
        return self.interval

    async def _timed_probe(self) -> tuple[bool, float, str]:
        started = self.clock.monotonic()
        try:
            async with asyncio.timeout(self.settings.probe_timeout):
                await self.client.probe()
            return True, self.clock.monotonic() - started, ""
        except TimeoutError:
            return False, self.clock.monotonic() - started, f"timed out after {self.settings.probe_timeout:g}s"
        except ProbeFailed as exc:
            return False, self.clock.monotonic() - started, str(exc)
        except Exception as exc:  # a probe client bug must not stop probing
            logger.exception("probe client raised")
            return False, self.clock.monotonic() - started, f"{type(exc).__name__}: {exc}"

    def _progressed(self) -> bool | None:
        """Whether the engine made progress since the previous round (None: it cannot tell)."""
        before = self._progress_seen
        self._progress_seen = now = self.progress()
        if now is None or before is None:
            return None
        return now != before

    def _why_counted(self, peak: float) -> str:
        if peak < self.settings.npu_usage_threshold:
            threshold = self.settings.npu_usage_threshold
            return f"the accelerator was idle (peak {peak:.0f}% < npu_usage_threshold {threshold:g}%)"
        return f"the engine made no progress (no tokens or scheduler steps) although utilization peaked at {peak:.0f}%"

    async def _health_problem(self) -> str:
        """'' when GET /health answers 200 (or there is no health client), else what went wrong."""
        if self.health is None:
            return ""
        try:
            await self.health.check()
            return ""
        except ProbeFailed as exc:
            return str(exc)

    def _count_health_failure(self, problem: str, probing: bool) -> None:
        self.health_failing = True
        self.consecutive_failures += 1
        logger.info("health check failed (%s; %d consecutive)", problem, self.consecutive_failures)
        if self.consecutive_failures >= self.settings.max_failure_count:
            self.machine.fire(
                Event.FAILURE_LIMIT,
                f"{self.consecutive_failures} consecutive health checks failed: {problem}"
                + (" (probes wait until it answers 200)" if probing else ""),
            )

    async def check_health_once(self) -> None:
        """A round without a probe (virtual inference off or paused): GET /health only. A failure
        counts toward max_failure_count; a 200 ends a streak of /health failures."""
        before = (self.consecutive_failures, self.machine.state, self.machine.reason)
        problem = await self._health_problem()
        if problem:
            self._count_health_failure(problem, probing=False)
        elif self.health_failing:
            self.health_failing, self.consecutive_failures = False, 0
            self.machine.fire(Event.HEALTH_RECOVERED, "GET /health answers 200 again")
        if before != (self.consecutive_failures, self.machine.state, self.machine.reason):
            if self.metrics is not None:
                self.metrics.consecutive_failures.set(self.consecutive_failures)
            self.on_health_check()

    async def run_health_checks(self) -> None:
        """GET /health every probe_interval, for as long as nothing probes."""
        while True:
            started = self.clock.monotonic()
            await self.check_health_once()
            await self.clock.sleep(max(0.0, self.settings.probe_interval - (self.clock.monotonic() - started)))

    async def probe_once(self) -> ProbeRecord:
        sent = self.clock.time()
        started = self.clock.monotonic() if self.health is not None else 0.0
        problem = await self._health_problem()
        if problem:  # probes run only while /health answers 200: this round failed there
            self._count_health_failure(problem, probing=True)
            self.interval = self.settings.probe_interval
            return self._finish(ProbeRecord(
                time=sent, success=False, latency=self.clock.monotonic() - started, error=problem,
                utilization_peak=0.0, next_interval=self.interval,
                consecutive_failures=self.consecutive_failures, counted=True, status=self.machine.state,
            ))  # fmt: skip
        if self._progress_seen is None:
            self._progress_seen = self.progress()  # the first round measures from its own start
        probe = asyncio.ensure_future(self._timed_probe())
        try:
            peak = await self.peak_sampler.peak()
            success, latency, error = await probe
        finally:
            probe.cancel()
        progressed = self._progressed()
        busy = peak >= self.settings.npu_usage_threshold and progressed is not False
        counted = not success and not busy
        if success:
            self.consecutive_failures = 0
        if success or counted:
            self.health_failing = False
        if counted:
            self.consecutive_failures += 1
        self.interval = self.next_interval(peak, progressed)
        if success:
            self.machine.fire(Event.PROBE_SUCCEEDED, "virtual-inference probes succeed again")
        elif self.consecutive_failures >= self.settings.max_failure_count:
            self.machine.fire(
                Event.FAILURE_LIMIT,
                f"{self.consecutive_failures} consecutive virtual-inference probes failed while "
                f"{self._why_counted(peak)}; last error: {error}",
            )
        record = ProbeRecord(
            time=sent,
            success=success,
            latency=latency,
            error=error,
            utilization_peak=peak,
            next_interval=self.interval,
            consecutive_failures=self.consecutive_failures,
            counted=counted,
            status=self.machine.state,
        )
        if not success:
            logger.info(
                "probe failed (%s; peak %.0f%%, %s, %d consecutive)",
                error,
                peak,
                "counted" if counted else f"not counted: {_BUSY_BECAUSE[progressed]}",
                self.consecutive_failures,
            )
        return self._finish(record)

    def _finish(self, record: ProbeRecord) -> ProbeRecord:
        self.last = record
        self._observe(record)
        self.on_record(record)
        return record

    def _observe(self, record: ProbeRecord) -> None:
        if self.metrics is None:
            return
        self.metrics.probes.labels("success" if record.success else "failure").inc()
        if record.counted:
            self.metrics.counted_failures.inc()
        self.metrics.probe_latency.observe(record.latency)
        self.metrics.probe_interval.set(record.next_interval)
        self.metrics.consecutive_failures.set(record.consecutive_failures)
        self.metrics.probe_utilization.set(record.utilization_peak)

    async def run(self) -> None:
        """Probe forever, start to start every `interval` (a round lasts at least the sampling window)."""
        while True:
            started = self.clock.monotonic()
            await self.probe_once()
            await self._wait_for_next_round(started + self.interval)

    async def _wait_for_next_round(self, due: float) -> None:
        """Wait until `due`. The busy interval holds only while the engine keeps making progress:
        it is read every probe_interval, and a span without any starts the next round at once, so
        an engine busy a moment ago that then hangs idle is probed as an idle one (issue 61 #11)."""
        quiet_span = self.settings.probe_interval
        while True:
            left = max(0.0, due - self.clock.monotonic())  # a round past due still yields the loop
            seen = self.progress() if self.interval > quiet_span else None
            if seen is None or left <= quiet_span:
                await self.clock.sleep(left)
                return
            await self.clock.sleep(quiet_span)
            if self.progress() == seen:
                self._progress_seen = seen  # the next round judges only its own span: quiet so far
                return
