"""Failing back the requests an engine holds (admission.py) through vLLM's ASGI middleware
(vllm_admission.py), with a stand-in app on this loop: what has sent nothing is answered 503,
what has begun is left alone, new client requests are refused and probes pass."""

from __future__ import annotations

import asyncio
import json

from engine_server.engines.admission import Admission
from engine_server.engines.base import probe_request_id
from engine_server.engines.vllm_admission import AdmissionMiddleware
from motor.engine_key import ENGINE_KEY_ENV


class Call:
    """One request through the middleware; `sent` is what reached the client."""

    def __init__(self, middleware: AdmissionMiddleware, request_id: str = "client"):
        self.sent: list[dict] = []
        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": [(b"x-request-id", request_id.encode())]}  # fmt: skip
        self.task = asyncio.ensure_future(middleware(scope, None, self._send))

    async def _send(self, message: dict) -> None:
        self.sent.append(message)

    def answer(self) -> tuple[int, dict]:
        body = b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")
        return self.sent[0]["status"], json.loads(body)


def engine_app(first_chunk: asyncio.Event, ended: list[str]):
    """Streams one chunk once `first_chunk` is set, then never ends (a hung engine)."""

    async def app(scope, receive, send):
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"", "more_body": True})  # a flush: no bytes
            await first_chunk.wait()
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            ended.append("cancelled")  # vLLM aborts the request here
            raise

    return app


async def test_what_has_sent_nothing_is_failed_back_what_has_begun_is_left_alone():
    admission, ended = Admission(), []
    began, waiting = asyncio.Event(), asyncio.Event()
    began.set()
    streaming = Call(AdmissionMiddleware(engine_app(began, ended), admission))
    held = Call(AdmissionMiddleware(engine_app(waiting, ended), admission))
    await asyncio.sleep(0.05)
    assert [m.get("status") for m in held.sent] == []  # its 200 is held back until its first bytes
    assert streaming.sent[0]["status"] == 200 and admission.held() == 1

    assert admission.stop_serving("no progress for 2.0 s with 2 requests in flight") == 1
    await asyncio.wait_for(held.task, 5)
    status, body = held.answer()
    assert status == 503
    assert body["error"] == {
        "message": "engine not serving: no progress for 2.0 s with 2 requests in flight",
        "type": "ServiceUnavailableError",
        "param": None,
        "code": 503,
    }
    assert (b"retry-after", b"1") in held.sent[0]["headers"]
    assert ended == ["cancelled"]  # the held request's work, not the stream's
    assert not streaming.task.done() and streaming.sent[-1]["body"] == b"data: 1\n\n"

    refused = Call(AdmissionMiddleware(engine_app(began, ended), admission))
    await asyncio.wait_for(refused.task, 5)
    assert refused.answer()[0] == 503 and refused.answer()[1]["error"]["message"].startswith("engine not serving")
    probe = Call(AdmissionMiddleware(engine_app(began, ended), admission), probe_request_id(1))
    await asyncio.sleep(0.05)
    assert probe.sent[0]["status"] == 200  # a recovery probe reaches the engine

    admission.serve_again()
    again = Call(AdmissionMiddleware(engine_app(began, ended), admission))
    await asyncio.sleep(0.05)
    assert again.sent[0]["status"] == 200
    for call in (streaming, probe, again):
        call.task.cancel()
    await asyncio.gather(streaming.task, probe.task, again.task, return_exceptions=True)


async def test_a_drain_refuses_probes_too_and_not_serving_does_not():
    admission = Admission()
    admission.stop_serving("3 client requests in a row failed with a server error and none succeeded")
    assert admission.refusal(probe=True) is None
    assert admission.refusal(probe=False).startswith("engine not serving: 3 client requests")
    admission.close()
    assert admission.refusal(probe=True).startswith("this engine is draining")


async def test_given_the_engines_key_vllms_routes_answer_401_without_it(monkeypatch):
    """motor/engine_key.py: /v1/ and inference need `Authorization: Bearer <key>`; /health and
    /metrics, which routers and Prometheus read, do not."""
    monkeypatch.setenv(ENGINE_KEY_ENV, "sk-engine")
    admission = Admission()

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def status(method: str, path: str, headers: list) -> int:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": method, "path": path, "headers": headers}
        await AdmissionMiddleware(app, admission)(scope, None, send)
        return sent[0]["status"]

    keyed = [(b"authorization", b"Bearer sk-engine")]
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/pooling")):
        assert await status(method, path, []) == 401, path
        assert await status(method, path, [(b"authorization", b"Bearer sk-other")]) == 401, path
        assert await status(method, path, keyed) == 200, path
    # an adapter's worker: vllm-router sends a Basic header of the URL's user part before the key's
    assert await status("POST", "/v1/completions", [(b"authorization", b"Basic c3FsOg=="), *keyed]) == 200
    assert await status("GET", "/health", []) == 200 and await status("GET", "/metrics", []) == 200
    monkeypatch.delenv(ENGINE_KEY_ENV)
    admission = Admission()
    assert await status("POST", "/v1/completions", []) == 200  # given no key, as before
