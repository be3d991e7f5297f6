"""Rollout invariants over random operator sequences (hypothesis), on the controller with a fake
node client (no process): apply (with or without a warm spare), apply while paused, pause, resume,
undo, delete, scale, rename the group, a version whose engines crash at start, an engine killed,
the controller restarted. After every reconcile pass:

- a serving instance is never stopped by the controller while fewer than
  count - max_unavailable serve after the pass (a delete aside: it stops everything);
- a rollout becomes COMPLETE only with the new revision's count serving;
- every endpoint names the model its engine was started with;
- a revision number never names two specs of one deployment name;
- a pause holds until the operator resumes, applies or undoes (also across a restart).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.rules.expansion import GroupSpecs
from motor.v1 import controller_pb2, types_pb2
from tests.support.controller_harness import Harness
from tests.support.rollout_checks import Cluster, union

C, T = controller_pb2, types_pb2
EXAMPLES = int(os.environ.get("MOTOR_ROLLOUT_EXAMPLES", "25"))
BAD_VERSION = 3  # its engines crash at start

apply = st.tuples(
    st.just("apply"),
    st.integers(0, BAD_VERSION),  # version
    st.integers(1, 3),  # count
    st.sampled_from(["sim-a", "sim-b"]),  # model
    st.integers(0, 1),  # max_unavailable
    st.sampled_from(["u", "u", "v"]),  # the group's name: a rename
    st.integers(0, 1),  # warm spares
)
operations = st.lists(
    st.one_of(
        apply,
        apply,
        st.tuples(st.just("pause")),
        st.tuples(st.just("resume")),
        st.tuples(st.just("undo")),
        st.tuples(st.just("delete")),
        st.tuples(st.just("kill"), st.integers(0, 3)),
        st.tuples(st.just("restart")),
        st.tuples(st.just("passes"), st.integers(1, 6)),
    ),
    min_size=1,
    max_size=14,
)


class Checked(Cluster):
    def __init__(self, h: Harness):
        super().__init__(h)
        self.specs: dict[int, bytes] = {}  # revision -> the spec it named
        self.model_of: dict[str, str] = {}  # spec hash -> the model it serves
        self.paused = False  # by the operator, not resumed since

    @property
    def ctl(self):
        return self.h.controller

    def deployment(self) -> tuple[C.Deployment, int] | None:
        return self.ctl.deployments.by_name.get("t")

    def applied(self, deployment: C.Deployment, revision: int, version: int) -> None:
        data = deployment.SerializeToString(deterministic=True)
        assert self.specs.setdefault(revision, data) == data, f"revision {revision} names two specs"
        spec_hash = GroupSpecs(deployment).hashes[deployment.instance_groups[0].name]
        self.model_of[spec_hash] = deployment.model
        if version == BAD_VERSION:
            self.bad.add(spec_hash)
        self.paused = False

    def rollout_state(self) -> int | None:
        if self.deployment() is None:
            return None
        return self.ctl.rollouts.status("t")[0]

    async def one_pass(self) -> None:
        ctl, h = self.ctl, self.h
        before_serving = self.serving()
        before_stops = len(h.client.stops())
        before_state = self.rollout_state()
        await self.serve(1)
        stopped = {engine.split("/")[0] for _, engine, _ in h.client.stops()[before_stops:]}
        current = self.deployment()
        after = self.serving()
        if current is not None:
            deployment, _ = current
            group = deployment.instance_groups[0]
            floor = group.count - deployment.strategy.max_unavailable
            withdrawn = stopped & before_serving
            assert not withdrawn or len(after) >= floor, (
                f"stopped serving {sorted(withdrawn)} with {len(after)} serving of count {group.count}"
            )
            state = self.rollout_state()
            if state == C.ROLLOUT_STATE_COMPLETE and before_state != C.ROLLOUT_STATE_COMPLETE:
                spec_hash = GroupSpecs(deployment).hashes[group.name]
                new = [i for i in after if ctl.instances[i].spec_hash == spec_hash]
                assert len(new) >= group.count, f"COMPLETE with {len(new)} of {group.count} new instances serving"
            if self.paused:
                assert state == C.ROLLOUT_STATE_PAUSED, "an operator's pause was lost"
        for e in ctl.list_endpoints(T.ROLE_UNSPECIFIED, ""):
            inst = ctl.instances[e.instance_id]
            assert list(e.models) == [self.model_of[inst.spec_hash]], f"{e.instance_id} listed as {list(e.models)}"

    async def run(self, op: tuple) -> None:
        ctl, h = self.ctl, self.h
        kind = op[0]
        if kind == "apply":
            _, version, count, model, max_unavailable, group, spares = op
            spec = union(count, latency=10 + version, model=model, strategy={"max_unavailable": max_unavailable})
            spec.instance_groups[0].name, spec.instance_groups[0].spares = group, spares
            deployment, revision = ctl.apply_deployment(spec)
            self.applied(deployment, revision, version)
        elif kind == "pause" and self.deployment() is not None:
            ctl.rollouts.pause("t")
            self.paused = True
        elif kind == "resume" and self.deployment() is not None:
            ctl.rollouts.resume("t")
            self.paused = False
        elif kind == "undo" and self.deployment() is not None:
            rollout = ctl.rollouts.rollouts.get("t")
            if rollout is not None and rollout.previous is not None:
                deployment, revision = await ctl.rollouts.undo("t")
                self.applied(deployment, revision, version=-1)  # a bad spec stays bad (its hash)
        elif kind == "delete" and self.deployment() is not None:
            ctl.delete_deployment("t")
            self.paused = False
        elif kind == "kill":
            serving = sorted(self.serving())
            if serving:
                self.crash(serving[op[1] % len(serving)])
                h.beat("node-a")
                await asyncio.sleep(0.01)
        elif kind == "restart":
            await h.stop()
            await h.start()
            await h.register("node-a", accelerators=16)
        passes = op[1] if kind == "passes" else 2
        for _ in range(passes):
            await self.one_pass()


async def replay(ops: list[tuple], directory: Path) -> None:
    h = Harness(directory)
    await h.start()
    await h.register("node-a", accelerators=16)
    c = Checked(h)
    try:
        for op in ops:
            await c.run(op)
    finally:
        await h.stop()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(operations)
def test_rollout_invariants_hold_over_random_operator_sequences(ops):
    with tempfile.TemporaryDirectory() as directory:
        asyncio.run(replay(ops, Path(directory)))
