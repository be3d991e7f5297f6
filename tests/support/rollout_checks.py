"""What the rollout tests read off a controller on fakes: the engines stopped, the rollout's summary,
a union deployment; and a cluster of fakes driven by operator sequences."""

from __future__ import annotations

import asyncio

from controller.rules.expansion import GroupSpecs
from motor.v1 import controller_pb2, types_pb2
from tests.support.controller_harness import Harness, small_deployment

C, T = controller_pb2, types_pb2


def union(count: int = 2, latency: int = 20, strategy: dict | None = None, **extra) -> C.Deployment:
    deployment = small_deployment(
        [{"name": "u", "role": "union", "count": count}], strategy={"min_ready": "0s", **(strategy or {})}, **extra
    )
    deployment.engine_config["motor_engine_union_config"]["engine_args"] = {"latency_ms": latency}
    return deployment


def stopped(h: Harness) -> set[str]:
    return {engine.split("/")[0] for _, engine, _ in h.client.stops()}


def summary(h: Harness) -> C.DeploymentSummary:
    return h.controller.list_deployments().deployments[0]


class Cluster:
    """The harness's controller on one node whose engines of the `bad` specs crash as soon as
    they start (a version that does not load)."""

    def __init__(self, h: Harness):
        self.h, self.bad = h, set()
        self.crashing: set[str] = set()  # instances whose engines crash in every pass, whatever their spec

    def crash_on_start(self) -> None:
        """The deployment as applied last (validated: defaults filled in) does not load."""
        self.bad.add(GroupSpecs(self.h.controller.deployments.by_name["t"][0]).hashes["u"])

    def crash(self, instance_id: str) -> None:
        for engine in self.h.client.engines["node-a"].values():
            if engine.engine_id.startswith(f"{instance_id}/") and engine.state != T.ENGINE_STATE_STOPPED:
                engine.state, engine.exit_code = T.ENGINE_STATE_FAILED, 1

    async def serve(self, passes: int = 8) -> None:
        ctl = self.h.controller
        for _ in range(passes):
            ctl.reconcile_once()
            await asyncio.sleep(0.02)
            self.h.client.set_health("node-a")
            for inst in list(ctl.instances.values()):
                if inst.spec_hash in self.bad or inst.instance_id in self.crashing:
                    self.crash(inst.instance_id)
            self.h.beat("node-a")
            await asyncio.sleep(0.02)

    async def serve_until_paused(self, passes: int = 10) -> None:
        """Serve pass by pass until the rollout pauses (on the crashing version); fails if it does not."""
        for _ in range(passes):
            await self.serve(1)
            if summary(self.h).rollout_state == C.ROLLOUT_STATE_PAUSED:
                return
        assert summary(self.h).rollout_state == C.ROLLOUT_STATE_PAUSED

    def serving(self) -> set[str]:
        return {e.instance_id for e in self.h.controller.list_endpoints(T.ROLE_UNSPECIFIED, "")}
