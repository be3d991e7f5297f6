"""The health check's own rules, exactly (in-process; mutation-tested with engine_server/probing.py):
the status line it reads, the address it checks, who answered, what a refusal says; and how the
prober waits for its next round while a busy engine keeps making progress."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from engine_server.probing import HttpHealthClient, HttpSession, ProbeFailed, _status
from tests.support import serve_app
from tests.support.probing_fakes import SEED, Progress, seed_prober
from tests.support.virtual_clock import VirtualClock


@pytest.mark.parametrize(
    "line, read",
    [
        (b"HTTP/1.1 200 OK\r\n", 200),
        (b"HTTP/1.1 503\r\n", 503),  # two parts are enough
        (b"HTTP/1.1\r\n", "'HTTP/1.1\\r\\n'"),  # no code
        (b"HTTP/1.1 OK 200\r\n", "'HTTP/1.1 OK 200\\r\\n'"),  # no number where the code goes
        (b"XTTP/1.1 200 OK\r\n", "'XTTP/1.1 200 OK\\r\\n'"),  # not an HTTP status line
        (b"", "nothing (connection closed)"),
        (b"\xff\xfe 200\r\n", "'\ufffd\ufffd 200\\r\\n'"),  # undecodable bytes shown, not raised
        (b"x" * 100, repr("x" * 80)),  # cut at 80 characters
    ],
)
def test_the_status_line_read(line, read):
    assert _status(line) == read


def test_the_address_checked_comes_from_the_url():
    client = HttpHealthClient("http://engine-host:8123", timeout=1)
    assert (client.host, client.port, client.url) == ("engine-host", 8123, "http://engine-host:8123/health")
    client = HttpHealthClient("http://:8123", timeout=1)
    assert (client.host, client.port) == ("127.0.0.1", 8123)
    client = HttpHealthClient("http://engine-host", timeout=1)
    assert (client.host, client.port) == ("engine-host", 80)


@pytest.fixture
async def health_url():
    app = web.Application()

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/health", ok)
    runner, url = await serve_app(app)
    yield url
    await runner.cleanup()


async def test_who_answered_is_asked_with_the_engines_port_and_this_connections_own(health_url):
    asked = []

    def stranger(port: int, local_port: int) -> str:
        asked.append((port, local_port))
        return ""

    client = HttpHealthClient(health_url, timeout=2, stranger=stranger)
    await client.check()
    [(port, local_port)] = asked
    assert port == client.port and isinstance(local_port, int) and local_port not in (0, client.port)


async def test_an_answer_from_another_process_fails_the_check_naming_it(health_url):
    client = HttpHealthClient(health_url, timeout=2, stranger=lambda port, local: "pid 4242 (nc)")
    with pytest.raises(ProbeFailed) as failed:
        await client.check()
    assert str(failed.value) == (
        f"GET /health on port {client.port} was answered by another process (pid 4242 (nc)), not this engine"
    )


async def test_a_connection_error_without_an_errno_names_the_address_alone(monkeypatch):
    async def refuse(host, port):
        raise OSError("no route")

    monkeypatch.setattr(asyncio, "open_connection", refuse)
    client = HttpHealthClient("http://127.0.0.1:9", timeout=2)
    with pytest.raises(ProbeFailed) as failed:
        await client.check()
    assert str(failed.value) == "GET /health failed: OSError at 127.0.0.1:9"


async def test_a_session_is_made_with_the_timeout_asked_for():
    holder = HttpSession()
    try:
        assert holder.session(aiohttp.ClientTimeout(total=1.5)).timeout.total == 1.5
    finally:
        await holder.close()


async def test_a_busy_engine_that_keeps_progressing_is_probed_at_its_busy_interval_not_later():
    clock, progress = VirtualClock(), Progress()
    prober, _ = seed_prober(clock, 90, progress)
    prober.interval = SEED.busy_probe_interval
    start = clock.monotonic()

    async def ticking() -> None:
        while True:
            progress.count += 1
            await clock.sleep(0.25)

    ticker = asyncio.create_task(ticking())
    waited = asyncio.create_task(prober._wait_for_next_round(start + SEED.busy_probe_interval))
    try:
        await clock.run_until(waited.done, limit=SEED.busy_probe_interval + 10)
    finally:
        ticker.cancel()
    assert clock.monotonic() - start == pytest.approx(SEED.busy_probe_interval)


async def test_a_quiet_span_ends_the_wait_and_the_next_round_judges_from_its_reading():
    clock, progress = VirtualClock(), Progress()
    prober, _ = seed_prober(clock, 90, progress)
    prober.interval, progress.count = SEED.busy_probe_interval, 7
    start = clock.monotonic()
    waited = asyncio.create_task(prober._wait_for_next_round(start + SEED.busy_probe_interval))
    await clock.run_until(waited.done, limit=SEED.busy_probe_interval + 10)
    assert clock.monotonic() - start == pytest.approx(SEED.probe_interval)  # one quiet span, not 20 s
    assert prober._progress_seen == 7  # what the next round's "progressed?" is measured from


async def test_progress_that_stops_in_the_last_span_still_counts_for_the_next_round():
    """The wait ends at its due time; the last span is not judged quiet on its own, so the next round
    measures from the previous round's end and sees the progress of this wait."""
    clock, progress = VirtualClock(), Progress()
    prober, _ = seed_prober(clock, 90, progress)
    prober.interval, prober._progress_seen = SEED.busy_probe_interval, 0
    start = clock.monotonic()
    stop_at = start + SEED.busy_probe_interval - SEED.probe_interval

    async def ticking() -> None:
        while clock.monotonic() < stop_at:
            progress.count += 1
            await clock.sleep(0.25)

    ticker = asyncio.create_task(ticking())
    waited = asyncio.create_task(prober._wait_for_next_round(start + SEED.busy_probe_interval))
    try:
        await clock.run_until(waited.done, limit=SEED.busy_probe_interval + 10)
    finally:
        ticker.cancel()
    assert clock.monotonic() - start == pytest.approx(SEED.busy_probe_interval)
    assert prober._progress_seen == 0 and prober._progressed() is True
