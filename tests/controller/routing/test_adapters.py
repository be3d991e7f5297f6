"""LoRA adapters at run time: the controller loads a deployment's adapters into every engine
that serves, through the engine's runtime LoRA API (here real simulated engines over HTTP),
without restarting it; a failed load is an event with the engine's answer, the engine keeps
serving the adapters that loaded, and its endpoint lists only those."""

from __future__ import annotations

import asyncio

import pytest

from engine_server.engines.base import EngineOptions
from engine_server.engines.sim import SimEngine
from motor.contract.router_workers import adapter_worker_url
from motor.engine_key import ENGINE_KEY_ENV
from motor.errors import InvalidArgument
from motor.ports import free_port
from motor.v1 import controller_pb2 as C
from tests.support import async_wait_for
from tests.support.controller_harness import small_deployment


@pytest.fixture
def engine_key(monkeypatch):
    """The engines' key (motor/engine_key.py) in the environment, before the engines start."""
    monkeypatch.setenv(ENGINE_KEY_ENV, "sk-motor-engine-test")


@pytest.fixture
async def sims():
    engines = []
    for _ in range(2):
        port = free_port()
        engine = SimEngine(
            EngineOptions(
                role="union",
                instance_id="u",
                dp_rank=0,
                host="127.0.0.1",
                port=port,
                master_dp_ip="127.0.0.1",
                engine_args={"model": "sim-chat"},
            )
        )
        await engine.start()
        engines.append(engine)
    yield engines
    for engine in engines:
        await engine.shutdown()


def adapter_folder(root, name: str) -> None:
    (root / "adapters" / name).mkdir(parents=True)
    (root / "adapters" / name / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')


def chat(*adapters: tuple[str, str]):
    return small_deployment(
        [{"name": "chat", "role": "union", "count": 2}],
        name="chat",
        model="sim-chat",
        adapters=[{"name": n, "path": p} for n, p in adapters],
    )


def models(ctl) -> dict[str, list[str]]:
    return {e.engine_id: list(e.models) for e in ctl.list_endpoints()}


async def serving_on_sims(harness, sims, root, deployment):
    """The controller with one node (model root `root`) whose two engines are the simulated
    engines `sims`, `deployment` applied and its engines started and healthy."""
    ctl = await harness.start()
    harness.client._ports = iter([sims[0].options.port, 1, sims[1].options.port, 1])  # the engines' ports: the sims'
    reply = await ctl.register_node(
        C.NodeInfo(
            node_id="node-a",
            address="127.0.0.1:1",
            host="127.0.0.1",
            accelerator_ids=[0, 1],
            accelerator_type="sim",
            model_roots=[str(root)],
        ),
        [],
    )
    harness.generations["node-a"] = reply.generation
    ctl.apply_deployment(deployment)
    ctl.reconcile_once()
    await async_wait_for(lambda: len(harness.client.starts()) == 2, timeout=5, what="two engines started")
    harness.client.set_health("node-a")
    harness.beat("node-a")
    return ctl


async def test_adapters_load_into_serving_engines_and_follow_the_list_without_a_restart(harness, sims, tmp_path):
    root = tmp_path / "models"
    adapter_folder(root, "sql")
    adapter_folder(root, "poem")
    ctl = await serving_on_sims(harness, sims, root, chat(("sql", "adapters/sql"), ("broken", "adapters/missing")))

    both = ["chat-0/rank0", "chat-1/rank0"]
    await async_wait_for(
        lambda: models(ctl) == {e: ["sim-chat", "sql"] for e in both}, timeout=10, what="sql loaded into both engines"
    )
    assert all(s.loras.loaded == {"sql": str(root / "adapters" / "sql")} for s in sims)

    def failures() -> list[str]:
        return [e.message for e in ctl.events.recent if e.type == C.EVENT_TYPE_ADAPTER and "failed" in e.message]

    await async_wait_for(lambda: len(failures()) == 2, timeout=10, what="the broken adapter's two failures")
    failed = failures()
    assert len(failed) == 2 and all(
        "adapter 'broken' (adapters/missing) failed to load" in m and "HTTP 404" in m and "No adapter found for" in m
        for m in failed
    ), failed
    assert all(e.deployment == "chat" for e in ctl.events.recent if e.type == C.EVENT_TYPE_ADAPTER)
    assert [e.engine_id for e in ctl.list_endpoints(model="sql")] == both

    ctl.apply_deployment(chat(("poem", "adapters/poem")))  # sql removed, poem added: no engine restarts
    await async_wait_for(
        lambda: models(ctl) == {e: ["sim-chat", "poem"] for e in both}, timeout=10, what="sql unloaded, poem loaded"
    )
    assert all(set(s.loras.loaded) == {"poem"} for s in sims)
    assert len(harness.client.starts()) == 2 and not harness.client.stops()
    assert ctl.list_endpoints(model="sql") == []


async def test_engines_given_motors_key_load_adapters_from_the_controller_which_sends_it(
    engine_key, harness, sims, tmp_path
):
    root = tmp_path / "models"
    adapter_folder(root, "sql")
    ctl = await serving_on_sims(harness, sims, root, chat(("sql", "adapters/sql")))
    await async_wait_for(
        lambda: all(s.loras.loaded == {"sql": str(root / "adapters" / "sql")} for s in sims),
        timeout=10,
        what="sql loaded into both keyed engines",
    )
    assert all(s.admission.key == "sk-motor-engine-test" for s in sims)  # (they ask for it)
    assert not [e.message for e in ctl.events.recent if e.type == C.EVENT_TYPE_ADAPTER and "failed" in e.message]


async def test_an_adapter_leaves_the_endpoints_and_is_unloaded_only_once_no_front_door_routes_to_it(
    harness, sims, tmp_path
):
    """Unloading first would leave the router sending the adapter's requests to engines that no
    longer have it until the sync hears of the change (a hostile run saw the engine's 404)."""
    root = tmp_path / "models"
    adapter_folder(root, "sql")
    ctl = await serving_on_sims(harness, sims, root, chat(("sql", "adapters/sql")))
    both = ["chat-0/rank0", "chat-1/rank0"]
    await async_wait_for(
        lambda: models(ctl) == {e: ["sim-chat", "sql"] for e in both}, timeout=10, what="sql loaded into both engines"
    )
    engines = [e.url for e in ctl.list_endpoints()]
    adapter_workers = [adapter_worker_url(url, "sql") for url in engines]
    ctl.front_doors.report("http://router:8081", [*engines, *adapter_workers], True, 2.0, "sync-1")

    ctl.apply_deployment(chat())  # sql removed
    await async_wait_for(
        lambda: models(ctl) == {e: ["sim-chat"] for e in both}, timeout=10, what="sql out of the endpoints"
    )
    await asyncio.sleep(0.5)
    assert all(set(s.loras.loaded) == {"sql"} for s in sims), "unloaded while the router still routes to it"

    ctl.front_doors.report("http://router:8081", engines, True, 2.0, "sync-1")  # the sync took it out

    def unloaded() -> list[str]:
        return sorted(
            e.message for e in ctl.events.recent if e.type == C.EVENT_TYPE_ADAPTER and "unloaded" in e.message
        )

    # The controller's events, not the engines' state: an engine has unloaded before the controller
    # reads its reply and announces it (waiting on the engines read the events too early under load).
    await async_wait_for(lambda: len(unloaded()) >= 2, timeout=5, what="sql unloaded once the router let it go")
    assert all(not s.loras.loaded for s in sims)
    await asyncio.sleep(0.3)  # a second unload, if one came, would be announced by now
    assert unloaded() == [f"adapter 'sql' unloaded from engine {e}" for e in both]


@pytest.mark.parametrize(
    "adapters, says",
    [
        (
            [{"name": "x", "path": "/etc/passwd"}],
            "adapters[0].path: '/etc/passwd' must be a folder inside the node's model root",
        ),
        (
            [{"name": "x", "path": "adapters/../../etc"}],
            "adapters[0].path: 'adapters/../../etc' must be a folder inside",
        ),
        (
            [{"name": "x", "path": "a"}, {"name": "x", "path": "b"}],
            "adapters[1].name: 'x' is already the name of adapters[0]",
        ),
        ([{"name": "sim-tiny", "path": "a"}], "adapters[0].name: 'sim-tiny' is the deployment's model"),
        (
            [{"name": f"a{i}", "path": f"a/{i}"} for i in range(1000)],
            "adapters: at most 64 adapters per deployment (got 1000)",
        ),
    ],
)
async def test_bad_adapters_are_refused_naming_the_field_and_change_nothing(harness, adapters, says):
    ctl = await harness.start()
    ctl.apply_deployment(small_deployment([{"name": "u", "role": "union"}]))
    with pytest.raises(InvalidArgument, match="invalid deployment") as refused:
        ctl.apply_deployment(small_deployment([{"name": "u", "role": "union"}], adapters=adapters))
    assert says in str(refused.value)
    assert ctl.get_deployment("t")[1] == 1 and not ctl.get_deployment("t")[0].adapters


async def test_an_adapter_may_not_take_another_deployment_s_model_name(harness):
    ctl = await harness.start()
    ctl.apply_deployment(small_deployment([{"name": "b", "role": "union"}], name="depb", model="sim-b"))
    with pytest.raises(InvalidArgument, match=r"adapters\[0\].name: 'sim-b' is the model of deployment 'depb'"):
        ctl.apply_deployment(
            small_deployment(
                [{"name": "a", "role": "union"}], name="depa", model="sim-a", adapters=[{"name": "sim-b", "path": "x"}]
            )
        )
    assert "depa" not in ctl.deployments.by_name
    ctl.apply_deployment(
        small_deployment(
            [{"name": "a", "role": "union"}], name="depa", model="sim-a", adapters=[{"name": "sim-a-lora", "path": "x"}]
        )
    )
    with pytest.raises(InvalidArgument, match="model: 'sim-a-lora' is an adapter of deployment 'depa'"):
        ctl.apply_deployment(small_deployment([{"name": "c", "role": "union"}], name="depc", model="sim-a-lora"))
