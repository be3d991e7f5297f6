"""The door sends the engines' key (motor/engine_key.py) on every request it passes on, in place of
any key the client sent: vllm-router passes a request's Authorization on to its engine."""

from __future__ import annotations

from front_door.messages import Request, forwarded
from front_door.router_pool import RouterPool
from motor.engine_key import ENGINE_KEY_ENV, authorization, presented


def request(headers: list[tuple[bytes, bytes]]) -> Request:
    return Request("POST", b"/v1/completions", "/v1/completions", headers, b"{}", True, False)


def test_the_engines_key_replaces_any_key_the_client_sent(monkeypatch):
    monkeypatch.setenv(ENGINE_KEY_ENV, "sk-engine")
    pool = RouterPool("http://127.0.0.1:9")
    assert pool.key_line == b"Authorization: Bearer sk-engine"
    sent = forwarded(
        request([(b"AUTHORIZATION", b"Bearer sk-client"), (b"X-Api-Key", b"sk-client"), (b"Accept", b"*/*")]),
        pool.host_header,
        b"{}",
        pool.key_line,
    )
    head = sent.split(b"\r\n\r\n")[0].split(b"\r\n")
    assert b"Authorization: Bearer sk-engine" in head and b"Accept: */*" in head
    assert not [line for line in head if b"sk-client" in line]
    assert head.count(b"Authorization: Bearer sk-engine") == 1


def test_without_the_engines_key_headers_pass_as_they_came(monkeypatch):
    monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)
    pool = RouterPool("http://127.0.0.1:9")
    assert pool.key_line == b""
    sent = forwarded(request([(b"Authorization", b"Bearer sk-client")]), pool.host_header, b"{}", pool.key_line)
    assert b"Authorization: Bearer sk-client\r\n" in sent


def test_presented_takes_exactly_the_key_as_a_bearer_token():
    assert presented(authorization("k")["Authorization"], "k")
    assert presented(b"bearer   k ", "k")
    for header in (None, "", "k", "Bearer", "Bearer kk", "Basic k", "Bearer k2"):
        assert not presented(header, "k"), header
