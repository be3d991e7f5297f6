"""A cluster whose front door takes API keys starts its engines with a key of their own that Motor
holds (motor/engine_key.py): an engine's OpenAI port reached directly, without it, answers 401
(a client that reaches the data network cannot walk around the door); through the door, which
sends it, requests are answered; the engine server's own probes and health carry it (the engine
turns NORMAL and stays in the router). Also in the router's prefill/decode flow, where the router
sends each leg a key of its own instead of the door's."""

from __future__ import annotations

import os

import httpx
import pytest

from motor.engine_key import ENGINE_KEY_ENV
from motorctl import router as front
from motorctl.door_access import ENGINE_KEY_FILE, DoorAccess
from motorctl.local_cluster import LocalCluster
from tests.support import REPO_ROOT, wait_for
from tests.support.keyed_door import key_file

pytestmark = pytest.mark.processes

CLIENT_KEY = "sk-motor-acme-engine-key-0123456789"
BODY = {"model": "sim-tiny", "prompt": "hello", "max_tokens": 4}


@pytest.mark.parametrize("router_pd", [False, True], ids=["regular", "prefill-decode"])
def test_engines_answer_only_with_motors_key(tmp_path, router_pd):
    keys = key_file(tmp_path / "keys.yaml", {"acme": {"models": ["*"]}}, {"acme": CLIENT_KEY})
    cluster = LocalCluster(
        str(tmp_path / "run"),
        nodes=1,
        deployment_path=os.path.join(REPO_ROOT, "examples", "local-deployment.yaml"),
        engine_port_base=36200 if router_pd else 36100,
        metrics_port=None,
        router_port=0,
        door_access=DoorAccess(api_keys=keys),
        router_pd=router_pd,  # (both legs then carry the key the router is given: motorctl/router.py)
    )
    try:
        cluster.start(timeout=90)
        engine_key = open(tmp_path / "run" / ENGINE_KEY_FILE).read().strip()
        assert oct(os.stat(tmp_path / "run" / ENGINE_KEY_FILE).st_mode & 0o777) == "0o600"
        assert engine_key and engine_key != CLIENT_KEY and ENGINE_KEY_ENV not in os.environ
        # the example's three engines (two prefill ranks and a decode engine, with router_pd)
        workers = wait_for(
            lambda: (listed := front.router_workers(cluster.router_admin_url)) and len(listed) == 3 and listed,
            timeout=60,
            what="three workers in the router",
        )
        engine = workers[0]
        door = httpx.Client(base_url=cluster.router_url, timeout=10)
        client = {"Authorization": f"Bearer {CLIENT_KEY}"}
        answered = door.post("/v1/completions", json=BODY, headers=client)
        assert answered.status_code == 200, answered.text
        assert answered.json()["usage"]["completion_tokens"] == 4

        direct = httpx.Client(base_url=engine, timeout=10)
        for headers in ({}, client, {"Authorization": f"Bearer {engine_key}x"}, {"x-api-key": engine_key}):
            refused = direct.post("/v1/completions", json=BODY, headers=headers)
            assert refused.status_code == 401, (headers, refused.text)
            assert refused.json()["error"]["code"] == "invalid_api_key"
        assert direct.get("/v1/models").status_code == 401
        assert direct.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}).status_code == 401
        assert direct.get("/health").status_code == 200  # what routers read stays open
        keyed = direct.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {engine_key}"})
        assert keyed.status_code == 200 and keyed.json()["choices"][0]["text"] == answered.json()["choices"][0]["text"]
        # the engine's own probes carry the key: it is still served after some rounds of them
        assert door.post("/v1/completions", json=BODY, headers=client).status_code == 200
        assert front.router_workers(cluster.router_admin_url) == workers
    finally:
        cluster.stop()
