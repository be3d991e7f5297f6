"""API keys at the front door (front_door/tenancy.py, front_door/keys.py; docs/security.md): no
request reaches the router without a key of a tenant, whatever its form, and a tenant reaches only
its models. Before: any client that reached the door's port used every model."""

from __future__ import annotations

import json

import openai
import pytest

from front_door.policy import FrontDoor
from tests.support import serve_app
from tests.support.keyed_door import KEYS, SERVED, StandIn, exchange, keyed_door, post

BODY = {"model": "m", "prompt": "hi", "max_tokens": 4}
ACME = ("Authorization", f"Bearer {KEYS['acme']}")


@pytest.fixture
async def door(tmp_path):
    tenants = {"acme": {"models": ["m", "m-*"]}, "beta": {"models": ["other"]}}
    door, router, cleanup = await keyed_door(tmp_path / "keys.yaml", tenants)
    yield door
    await cleanup()


def status_and_body(data: bytes) -> tuple[int, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body) if body.startswith(b"{") else {}


async def test_without_keys_any_client_uses_every_model(tmp_path):
    """The reproduction: the door as it was (no key file) answers a request with no key."""
    router = StandIn()
    runner, url = await serve_app(router.app())
    door = FrontDoor(url, lambda: SERVED)
    from motor.ports import free_port

    door.port = free_port()
    await door.start("127.0.0.1", door.port)
    try:
        status, body = status_and_body(await exchange(door.port, post("/v1/completions", BODY)))
        assert status == 200 and body["usage"]["prompt_tokens"] == 10
    finally:
        await door.close()
        await runner.cleanup()


async def test_no_key_wrong_key_are_refused_401_in_openais_shape_and_the_router_sees_nothing(door):
    router = door.router_stand_in
    for headers, code in [((), None), ((("Authorization", "Bearer sk-motor-wrong"),), "invalid_api_key")]:
        data = await exchange(door.port, post("/v1/completions", BODY, headers))
        status, body = status_and_body(data)
        assert status == 401, data
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == code
        assert b"www-authenticate: bearer" in data.lower() and b"connection: close" in data.lower()
        assert b"sk-motor" not in data  # the key is never named
    assert router.seen == []
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{door.port}/v1", api_key="sk-motor-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await client.completions.create(**BODY)
    rejections = door.metrics.registry.get_sample_value(
        "motor_front_door_tenant_rejections_total", {"tenant": "", "reason": "bad_key"}
    )
    assert rejections == 2


async def test_a_key_reaches_its_tenants_models_and_is_not_passed_on(door):
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{door.port}/v1", api_key=KEYS["acme"], max_retries=0)
    answer = await client.completions.create(**BODY)
    assert answer.usage.prompt_tokens == 10
    [seen] = door.router_stand_in.seen
    assert not {name.lower() for name in seen["headers"]} & {"authorization", "x-api-key"}
    # the model list and the surface are the tenant's: `other` is beta's
    models = await client.models.list()
    assert sorted(model.id for model in models.data) == ["m", "m-lora"]
    with pytest.raises(openai.NotFoundError, match="do not have access") as raised:
        await client.completions.create(**{**BODY, "model": "other"})
    assert "other" not in raised.value.message.split("Valid aliases:")[1]
    beta = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{door.port}/v1", api_key=KEYS["beta"], max_retries=0)
    assert (await beta.completions.create(**{**BODY, "model": "other"})).model == "other"
    # a request without `model` is given the tenant's one model, not refused for the models of others
    assert (await beta.completions.create(model="", prompt="hi", max_tokens=2)).model == "other"


@pytest.mark.parametrize(
    "headers",
    [
        [("authorization", f"bearer {KEYS['acme']}")],  # names and schemes are case-insensitive
        [("AUTHORIZATION", f"BEARER   {KEYS['acme']}")],
        [("x-api-key", KEYS["acme"])],  # Anthropic's clients
    ],
)
async def test_header_forms_of_a_good_key(door, headers):
    status, _ = status_and_body(await exchange(door.port, post("/v1/completions", BODY, headers)))
    assert status == 200


@pytest.mark.parametrize(
    "headers",
    [
        [ACME, ACME],  # two keys: the door and what is behind it could read different ones
        [ACME, ("Authorization", "Bearer sk-motor-wrong")],
        [("Authorization", "Bearer sk-motor-wrong"), ACME],
        [ACME, ("x-api-key", KEYS["acme"])],
        [("Authorization", f"Basic {KEYS['acme']}")],
        [("Authorization", KEYS["acme"])],
        [("Authorization", "Bearer")],
        [("Authorization", f"Bearer {KEYS['acme']}x")],
        [("Authorization", f"Bearer {KEYS['acme'][:-1]}")],
    ],
)
async def test_header_forms_that_step_around_the_check_are_refused(door, headers):
    status, _ = status_and_body(await exchange(door.port, post("/v1/completions", BODY, headers)))
    assert status == 401
    assert door.router_stand_in.seen == []


async def test_absolute_form_targets_and_pipelining_behind_an_authorized_request(door):
    # absolute form: read by its path, checked the same
    data = await exchange(door.port, post("/v1/completions", BODY, target="http://door/v1/completions"))
    assert status_and_body(data)[0] == 401
    # an authorized request, then one without a key and one with on the same connection: each is
    # checked; the refused one closes the connection, the third is never read
    keyed = post("/v1/completions", BODY, [ACME])
    pipelined = keyed + post("/v1/completions", BODY) + keyed
    data = await exchange(door.port, pipelined, reads=3)
    assert [int(part.split(b" ")[0]) for part in data.split(b"HTTP/1.1 ")[1:]] == [200, 401]
    assert len(door.router_stand_in.seen) == 1


@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/add_worker?url=http://evil:1"),
        ("GET", "/list_workers"),
        ("GET", "/workers"),
        ("POST", "/v1/audio/transcriptions"),  # a model named in a form: not read by the door
        ("GET", "/metrics"),  # every tenant's series: on the door's private table port instead
        ("GET", "/v1/completions"),
    ],
)
async def test_with_keys_only_the_openai_surface_is_passed(door, method, path):
    request = f"{method} {path} HTTP/1.1\r\nHost: door\r\nAuthorization: Bearer {KEYS['acme']}\r\n"
    request += "Content-Length: 0\r\n\r\n"
    status, body = status_and_body(await exchange(door.port, request.encode()))
    assert status in (403, 404), body
    assert door.router_stand_in.seen == []


async def test_health_needs_no_key(door):
    status, _ = status_and_body(await exchange(door.port, b"GET /health HTTP/1.1\r\nHost: door\r\n\r\n"))
    assert status == 200
