"""`motorctl up --api-keys FILE --tls-cert ... --tls-key ...`: the front door of a real cluster
(vllm-router, simulated engines) takes only the file's keys, over TLS; OpenAI's client raises
AuthenticationError for a wrong key and RateLimitError at a tenant's limit; the router and the
engines stay on loopback (tests/e2e/test_local_listeners_on_loopback.py)."""

from __future__ import annotations

import os
import signal
import ssl
import time

import httpx
import openai
import pytest

from front_door.keys import digest
from motor.ports import free_port
from motor.security.pki import CertificateAuthority
from motorctl.door_access import development_access
from tests.support import wait_for
from tests.support.keyed_door import key_file
from tests.support.motorctl_up import assert_nothing_left, motorctl_up_argv, start_motorctl_up

pytestmark = pytest.mark.processes

KEYS = {"acme": "sk-motor-acme-e2e-0123456789", "small": "sk-motor-small-e2e-0123456789"}


def client(url: str, key: str, ca: str) -> openai.OpenAI:
    verify = ssl.create_default_context(cafile=ca)
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, http_client=httpx.Client(verify=verify))


def test_motorctl_up_with_api_keys_and_tls(tmp_path):
    ca = CertificateAuthority.create()
    ca_path, _ = ca.save(str(tmp_path / "ca"))
    cert, key = ca.issue(None, hosts=["127.0.0.1"]).save(str(tmp_path / "tls"), "door")
    tenants = {"acme": {"models": ["sim-*"]}, "small": {"limits": {"requests_per_minute": 2}}}
    keys = key_file(tmp_path / "keys.yaml", tenants, KEYS)
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    flags = ["--router-port", str(port), "--metrics-port", str(free_port()), "--controller-port", str(free_port())]
    flags += ["--api-keys", keys, "--tls-cert", cert, "--tls-key", key]
    screen = open(tmp_path / "screen.txt", "w+")
    up = start_motorctl_up(motorctl_up_argv(tmp_path / "run", *flags), stdout=screen)
    try:
        acme = client(url, KEYS["acme"], ca_path)

        def models():
            assert up.poll() is None, f"motorctl up ended: {up.stderr.read()}"
            try:
                return [model.id for model in acme.models.list().data]
            except (openai.APIConnectionError, openai.APIStatusError):
                return None

        assert wait_for(models, timeout=120, interval=0.5, what="the door's model list") == ["sim-tiny"]
        answer = acme.completions.create(model="sim-tiny", prompt="hello", max_tokens=4)
        assert answer.usage.completion_tokens == 4
        text = "".join(
            chunk.choices[0].text
            for chunk in acme.completions.create(model="sim-tiny", prompt="hello", max_tokens=4, stream=True)
            if chunk.choices
        )
        assert text == answer.choices[0].text
        with pytest.raises(openai.AuthenticationError):
            client(url, "sk-motor-not-a-key", ca_path).models.list()
        with pytest.raises(openai.APIConnectionError):  # plain HTTP is not served
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEYS["acme"], max_retries=0).models.list()
        small = client(url, KEYS["small"], ca_path)
        for _ in range(2):
            small.completions.create(model="sim-tiny", prompt="hi", max_tokens=2)
        with pytest.raises(openai.RateLimitError) as raised:
            small.completions.create(model="sim-tiny", prompt="hi", max_tokens=2)
        assert int(raised.value.response.headers["retry-after"]) == 30
        screen.seek(0)
        shown = screen.read()
        assert f"https://127.0.0.1:{port}/v1" in shown and f"API keys: {keys}" in shown
        assert KEYS["acme"] not in open(tmp_path / "run" / "logs" / "front-door.log").read()
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGINT)
            deadline = time.monotonic() + 60
            while up.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
        assert_nothing_left(tmp_path / "run")


def test_secure_door_makes_a_key_and_a_certificate_and_says_how_to_use_them(tmp_path):
    access = development_access(str(tmp_path))
    secret = open(access.dev_key).read().strip()
    assert digest(secret).hex() in open(access.api_keys).read() and secret not in open(access.api_keys).read()
    assert oct(os.stat(access.dev_key).st_mode & 0o777) == "0o600"
    assert access.args() == ["--api-keys", access.api_keys, "--tls-cert", access.tls_cert, "--tls-key", access.tls_key]
    how = access.how_to("https://127.0.0.1:8080")
    assert f"--cacert {access.ca}" in how and f"$(cat {access.dev_key})" in how
