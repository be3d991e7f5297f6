"""No group's or deployment's failure stops another's autoscaling.

- A target_in_flight so small that its arithmetic overflows (1.0e-310, accepted before its range
  was checked, so a store may hold it) raised OverflowError every second and aborted the whole
  pass, and a deployment beside it never scaled. Such a target is now refused at apply, naming the
  field and its range.
- Each group's look was isolated, but the check of whether a deployment's rollout holds its groups
  ran outside it, so one that raised aborted the whole pass and the deployments after it never
  scaled."""

from __future__ import annotations

from contextlib import asynccontextmanager

import pytest

from controller.capacity.autoscaler import FAST_S
from controller.model.deployments import COMPLETE
from controller.model.instances import READY
from controller.rules.deployment_checks import validate_deployment
from motor.errors import InvalidArgument
from tests.support import async_wait_for
from tests.support.controller_fakes import ManualClock
from tests.support.controller_harness import Harness, small_deployment


def scaled(name: str, group: str, target: float = 4.0):
    deployment = small_deployment(
        [{"name": group, "role": "union", "count": 1, "autoscaling": {"max": 4, "target_in_flight": target}}],
        strategy={"min_ready": "0s"},
    )
    deployment.name = name
    return deployment


@pytest.mark.parametrize("target", [1.0e-310, 1e-9, 1e300])
def test_a_target_outside_its_range_is_refused_naming_the_field_and_the_range(target):
    with pytest.raises(InvalidArgument) as refused:
        validate_deployment(scaled("a", "chat", target))
    message = str(refused.value)
    assert "instance_groups[0].autoscaling.target_in_flight: must be from 0.01 to 1000000" in message


@asynccontextmanager
async def broken_and_healthy(tmp_path):
    """Deployments "broken" (group "bad", applied first: the pass looks at it before the other)
    and "healthy" (group "good"), one READY instance each, their rollouts COMPLETE."""
    clock = ManualClock()
    h = Harness(tmp_path, clock=clock)
    try:
        await h.start()
        await h.register("node-a", accelerators=8)
        ctl = h.controller
        ctl.apply_deployment(scaled("broken", "bad"))
        ctl.apply_deployment(scaled("healthy", "good"))
        await async_wait_for(lambda: len(h.client.starts()) == 2, timeout=5, what="2 StartEngine calls")
        h.client.set_health("node-a")
        h.beat("node-a")
        await async_wait_for(lambda: all(i.state == READY for i in ctl.instances.values()), timeout=5, what="READY")
        await async_wait_for(
            lambda: all(ctl.rollouts.status(n)[0] == COMPLETE for n in ("broken", "healthy")), timeout=5, what="done"
        )
        yield ctl, clock
    finally:
        await h.stop()


async def overload_until_healthy_scales(ctl, clock) -> None:
    ctl.autoscaler.in_flight = lambda group: 40.0  # ten times the target on one engine: an overload
    for _ in range(int(FAST_S) + 2):
        clock.advance(1.0)
        ctl.autoscaler.tick()
    await async_wait_for(
        lambda: ctl.deployments.by_name["healthy"][0].instance_groups[0].count == 4,
        timeout=5,
        what="the healthy deployment scaled to 4",
    )


async def test_a_group_whose_arithmetic_raises_does_not_stop_another_group_scaling(tmp_path):
    async with broken_and_healthy(tmp_path) as (ctl, clock):
        # As a store written before the range was checked holds it (memory is what the pass reads).
        broken, revision = ctl.deployments.by_name["broken"]
        broken.instance_groups[0].autoscaling.target_in_flight = 1.0e-310
        ctl.deployments.set_deployment("broken", broken, revision)
        await overload_until_healthy_scales(ctl, clock)
        assert "OverflowError" in ctl.autoscaler.scalers[("broken", "bad")].last


async def test_a_deployment_whose_hold_check_raises_does_not_stop_another_deployment_scaling(tmp_path):
    async with broken_and_healthy(tmp_path) as (ctl, clock):
        status = ctl.rollouts.status

        def failing(name: str):
            if name == "broken":
                raise RuntimeError("a rollout record that cannot be read")
            return status(name)

        ctl.rollouts.status = failing
        await overload_until_healthy_scales(ctl, clock)
        assert ctl.deployments.by_name["broken"][0].instance_groups[0].count == 1
        last = ctl.autoscaler.scalers[("broken", "bad")].last
        assert "autoscaling failed: RuntimeError: a rollout record that cannot be read" in last
