"""The probe's and the health check's HTTP clients against real local servers (in-process): the
URL each calls, what a failure says, timeouts, and closing.

Like test_probing_rules.py, written to kill the mutants `make mutation` found surviving."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp import web

from engine_server.probing import HttpHealthClient, HttpProbeClient, ProbeFailed
from motor.engine_key import ENGINE_KEY_ENV
from motor.ports import free_port
from tests.support import serve_app


@contextlib.asynccontextmanager
async def answering(method, path: str, answer: dict, respond):
    """The base URL of an in-process server whose `method` `path` answers `respond()`, or hangs
    while `answer["hang"]` (hung requests released at the end)."""
    released = asyncio.Event()

    async def handler(request):
        if answer["hang"]:
            await released.wait()
        return respond()

    app = web.Application()
    app.add_routes([method(path, handler)])
    runner, url = await serve_app(app)
    try:
        yield url
    finally:
        released.set()
        await runner.cleanup()


# ------------------------------------------------------------------ the HTTP probe client


@pytest.fixture
async def completions():
    """A /v1/completions server whose answer the test sets (status, raw body, whether it hangs)."""
    answer = {"status": 200, "body": '{"choices": [{"text": "x"}]}', "hang": False}

    def respond():
        return web.Response(status=answer["status"], text=answer["body"], content_type="application/json")

    async with answering(web.post, "/v1/completions", answer, respond) as url:
        yield url, answer


@pytest.mark.parametrize(
    "base, url",
    [("http://10.0.0.1:8000/", "http://10.0.0.1:8000/v1/completions"),
     ("http://10.0.0.1:8000", "http://10.0.0.1:8000/v1/completions"),
     ("http://ENGINE-BOX/", "http://ENGINE-BOX/v1/completions")],
)  # fmt: skip
def test_the_probe_url_is_the_completions_route_of_the_base_url(base, url):
    assert HttpProbeClient(base, "prefill", 1).url == url


async def test_long_bad_answers_are_cut_to_200_characters(completions):
    url, answer = completions
    client = HttpProbeClient(url, "prefill", timeout=5)
    try:
        answer.update(status=500, body="e" * 300)
        with pytest.raises(ProbeFailed) as failed:
            await client.probe()
        assert str(failed.value) == "HTTP 500: " + "e" * 200
        answer.update(status=200, body="n" * 300)
        with pytest.raises(ProbeFailed) as failed:
            await client.probe()
        assert str(failed.value) == "answer is not JSON: " + "n" * 200
        answer.update(body='{"choices": []' + " " * 300 + "}")
        with pytest.raises(ProbeFailed) as failed:
            await client.probe()
        assert str(failed.value) == "answer has no choices: " + ('{"choices": []' + " " * 300)[:200]
    finally:
        await client.close()


@pytest.mark.parametrize(
    "server, client, call, message",
    [("completions", lambda url: HttpProbeClient(url, "prefill", timeout=0.2), "probe", r"^timed out after 0\.2s$"),
     ("health_endpoint", lambda url: HttpHealthClient(url, timeout=0.2), "check",
      r"^GET /health timed out after 0\.2s$")],
    ids=["probe", "health"],
)  # fmt: skip
async def test_a_slow_answer_times_out_at_the_clients_timeout(
    completions, health_endpoint, server, client, call, message
):
    """The probe's and the health check's clients alike: a hung server fails at the client's timeout."""
    url, answer = {"completions": completions, "health_endpoint": health_endpoint}[server]
    answer["hang"] = True
    client = client(url)
    try:
        with pytest.raises(ProbeFailed, match=message):
            await asyncio.wait_for(getattr(client, call)(), 10)  # the outer bound only catches a missing timeout
    finally:
        await client.close()


async def test_a_refused_connection_names_the_error_type():
    client = HttpProbeClient(f"http://127.0.0.1:{free_port()}", "prefill", timeout=2)
    try:
        with pytest.raises(ProbeFailed, match=r"^ClientConnector\w*Error: "):
            await client.probe()
    finally:
        await client.close()


async def test_the_client_can_be_closed_unused_and_probes_again_after_close(completions):
    url, _ = completions
    await HttpProbeClient(url, "prefill", timeout=5).close()
    client = HttpProbeClient(url, "prefill", timeout=5)
    await client.probe()
    await client.close()
    await client.probe()  # a new session
    await client.close()


# ------------------------------------------------------------------ GET /health: the HTTP client


@pytest.fixture
async def health_endpoint():
    """(base URL, answer): a GET /health server whose status the test sets, or that hangs."""
    answer = {"status": 200, "hang": False}
    async with answering(web.get, "/health", answer, lambda: web.Response(status=answer["status"], text="")) as url:
        yield url, answer


@pytest.mark.parametrize(
    "base, url",
    [("http://10.0.0.1:8000/", "http://10.0.0.1:8000/health"),
     ("http://10.0.0.1:8000", "http://10.0.0.1:8000/health"),
     ("http://ENGINE-BOX/", "http://ENGINE-BOX/health")],
)  # fmt: skip
def test_the_health_url_is_the_health_route_of_the_base_url(base, url):
    assert HttpHealthClient(base, 1).url == url


async def test_health_passes_on_200_and_names_any_other_status(health_endpoint):
    url, answer = health_endpoint
    client = HttpHealthClient(url, timeout=5)
    try:
        await client.check()
        answer["status"] = 503
        with pytest.raises(ProbeFailed) as failed:
            await client.check()
        assert str(failed.value) == "GET /health answered 503"
        answer["status"] = 201
        with pytest.raises(ProbeFailed, match=r"^GET /health answered 201$"):
            await client.check()
    finally:
        await client.close()


async def test_a_refused_health_check_names_the_error_type_and_the_address():
    port = free_port()
    client = HttpHealthClient(f"http://127.0.0.1:{port}", timeout=2)
    try:
        with pytest.raises(
            ProbeFailed,
            match=rf"^GET /health failed: ConnectionRefusedError at 127\.0\.0\.1:{port} \(Connection refused\)$",
        ):
            await client.check()
    finally:
        await client.close()


async def test_the_health_client_can_be_closed_unused_and_checks_again_after_close(health_endpoint):
    url, _ = health_endpoint
    await HttpHealthClient(url, timeout=5).close()
    client = HttpHealthClient(url, timeout=5)
    await client.check()
    await client.close()
    await client.check()  # a connection of its own each time
    await client.close()


# ------------------------------------------------------------------ the engines' key


@pytest.mark.parametrize("key", ["sk-motor-engine-test", None])
async def test_the_probe_carries_the_engines_key_when_motor_holds_one_and_no_authorization_otherwise(monkeypatch, key):
    """A keyed engine answers 401 to a probe without its key: the probe would mark it ABNORMAL."""
    if key is None:
        monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(ENGINE_KEY_ENV, key)
    seen: list[str | None] = []

    async def handler(request):
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"choices": [{"text": "x"}]})

    app = web.Application()
    app.add_routes([web.post("/v1/completions", handler)])
    runner, url = await serve_app(app)
    client = HttpProbeClient(url, "union", timeout=2)
    try:
        await client.probe()
    finally:
        await client.close()
        await runner.cleanup()
    assert seen == [f"Bearer {key}" if key else None]
