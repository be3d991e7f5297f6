"""`deployment 'x' applied (revision N, ...)` counts the deployment's instances as they are once
the change is made: a rolling update's old instances serve on (it said `0 instances` while two served)."""

from __future__ import annotations

from motor.contract.deployment_file import deployment_from_dict
from motor.v1 import controller_pb2 as C
from tests.support import async_wait_for

SECTIONS = {f"motor_engine_{r}_config": {"engine_type": "sim"} for r in ("prefill", "decode", "union")}


def chat(**engine) -> C.Deployment:
    sections = {**SECTIONS, "motor_engine_union_config": {"engine_type": "sim", **engine}}
    groups = [{"name": "chat", "role": "union", "count": 2}]
    return deployment_from_dict(
        {"name": "chat", "model": "sim-chat", "engine_config": sections, "instance_groups": groups}
    )


def applied(ctl) -> list[str]:
    return [e.message for e in ctl.state.events.recent if "applied (revision" in e.message]


async def test_the_apply_message_counts_the_instances_a_rolling_update_keeps(harness):
    ctl = await harness.start()
    await harness.register("node-a", accelerators=4)
    ctl.apply_deployment(chat())
    ctl.reconcile_once()
    await async_wait_for(lambda: len(harness.client.starts()) == 2, timeout=5, what="both engines started")
    ctl.apply_deployment(chat(engine_args={"latency_ms": 20}))  # a new spec: rolled out instance by instance
    assert applied(ctl)[-1].startswith("deployment 'chat' applied (revision 2, 2 instances, "), applied(ctl)
    assert applied(ctl)[-1].endswith(" serving)"), applied(ctl)
