"""No deployment's failure stops another's autoscaling: each group's look was isolated already, but
the check of whether a deployment's rollout holds its groups ran outside it, so one that raised
aborted the whole pass and the deployments after it never scaled."""

from __future__ import annotations

from controller.capacity.autoscaler import FAST_S
from controller.model.deployments import COMPLETE
from controller.model.instances import READY
from tests.support import async_wait_for
from tests.support.controller_fakes import ManualClock
from tests.support.controller_harness import Harness, small_deployment


def scaled(name: str, group: str):
    block = {"max": 4, "target_in_flight": 4.0}
    deployment = small_deployment(
        [{"name": group, "role": "union", "count": 1, "autoscaling": block}], strategy={"min_ready": "0s"}
    )
    deployment.name = name
    return deployment


async def test_a_deployment_whose_hold_check_raises_does_not_stop_another_deployment_scaling(tmp_path):
    clock = ManualClock()
    h = Harness(tmp_path, clock=clock)
    try:
        await h.start()
        await h.register("node-a", accelerators=8)
        ctl = h.controller
        ctl.apply_deployment(scaled("broken", "bad"))  # first: the pass looks at it before the other
        ctl.apply_deployment(scaled("healthy", "good"))
        await async_wait_for(lambda: len(h.client.starts()) == 2, timeout=5, what="2 StartEngine calls")
        h.client.set_health("node-a")
        h.beat("node-a")
        await async_wait_for(lambda: all(i.state == READY for i in ctl.instances.values()), timeout=5, what="READY")
        await async_wait_for(
            lambda: all(ctl.rollouts.status(n)[0] == COMPLETE for n in ("broken", "healthy")), timeout=5, what="done"
        )
        status = ctl.rollouts.status

        def failing(name: str):
            if name == "broken":
                raise RuntimeError("a rollout record that cannot be read")
            return status(name)

        ctl.rollouts.status = failing
        ctl.autoscaler.in_flight = lambda group: 40.0  # ten times the target on one engine: an overload
        for _ in range(int(FAST_S) + 2):
            clock.advance(1.0)
            ctl.autoscaler.tick()
        await async_wait_for(
            lambda: ctl.deployments.by_name["healthy"][0].instance_groups[0].count == 4,
            timeout=5,
            what="the healthy deployment scaled to 4",
        )
        assert ctl.deployments.by_name["broken"][0].instance_groups[0].count == 1
        last = ctl.autoscaler.scalers[("broken", "bad")].last
        assert "autoscaling failed: RuntimeError: a rollout record that cannot be read" in last
    finally:
        await h.stop()
