"""Autoscaling of instance groups on their engines' requests in flight (docs/autoscaling.md).

The signal is what the controller already sees every heartbeat: each engine's requests in flight
(running + waiting, probes excluded) averaged by its engine server over its last second (an
instant's count swings with random arrivals: engine_server/load_meter.py), summed over the group's
serving READY engines, one sample a second, and taken as the median of the last WINDOW_S seconds
(a step of the load counts once it has held for half the window, in full; a single burst or a noisy
sample does not). A decision:

- up: when the window's median is above UP_TOLERANCE x the target per engine, or at once when every
  sample of the last FAST_S seconds is FAST_RATIO x the target per engine or more (an overload
  that noise or a short burst does not explain: a queue building on saturated engines, which the
  window's median would let grow for half the window), ceil(load / target) engines at once, the
  load being the largest of those medians (a growing queue makes the window lag): a tripled load
  adds what it needs in one step, within min .. max;
- down: only to the count that keeps each engine at or below DOWN_RATIO x the target (hysteresis:
  the next sample does not scale it back up), and only once that has held for the whole
  scale_down_delay_s (the highest such count over the delay is taken). That count does not depend
  on how many engines serve (the load in flight is the arrivals times their time in an engine),
  so a scale-down keeps what the delay has seen: a second step down follows as soon as the
  figures of the load's way down have aged out, not after a whole new delay;
- after a change the window starts again: the next decision sees only samples of the new count,
  so under a steady load there is at most one change (one direction) per window; only a clear
  overload (FAST_RATIO x the target over FAST_S) is met before the window has refilled.

GroupScaler is the plain decision of one group, on a clock it is given (tests feed it series).
Autoscaler runs them on the leader, where the rollouts run, and acts through the deployment's own
apply: the decided count is the stored deployment's `count`, so a restart or a failover reads it
back and continues from it without a jump; its rollout record says the revision is the
autoscaler's own (controller/model/deployments.py), so the next controller holds the group as this
one would.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from controller.capacity.spares import Spares
from controller.deploy.rollout import DeploymentWrites, Rollouts
from controller.deploy.rollout_plan import index_of
from controller.model import reported as reported_engine
from controller.model.cluster import ClusterState
from controller.model.deployments import Deployments
from controller.model.instances import READY, InstanceRecord
from controller.store.interface import StoreUnavailable
from motor.errors import FailedPrecondition
from motor.v1 import controller_pb2, types_pb2

logger = logging.getLogger(__name__)

C, T = controller_pb2, types_pb2

WINDOW_S = 10.0  # the load is averaged over this long; also the stabilization window after a change
DOWN_RATIO = 0.8  # scale down only to a count that keeps each engine at or below 0.8 x the target
# Scale up only when the median is more than 10 % above the target per engine (Kubernetes' HPA keeps
# the same tolerance): a load that sits on the target, whose median wanders just above and below
# it, does not add an engine each time it is a little above.
UP_TOLERANCE = 1.1
FAST_S = 3.0  # a clear overload (FAST_RATIO x the target) is met once it has held this long
FAST_RATIO = 4.0


@dataclass(frozen=True)
class ScalePolicy:
    min: int
    max: int
    target: float
    scale_down_delay_s: float

    @classmethod
    def of(cls, block: C.Autoscaling) -> ScalePolicy:  # a validated block (defaults filled in)
        return cls(block.min, block.max, block.target_in_flight, block.scale_down_delay_s)


@dataclass(frozen=True)
class Decision:
    group: str
    old: int
    new: int
    message: str


class GroupScaler:
    """The decisions of one group. `step` is fed one sample per tick: the time, the group's serving
    count and its engines' total requests in flight."""

    def __init__(self, group: str, policy: ScalePolicy, now: float):
        self.group, self.policy = group, policy
        self.samples: deque[tuple[float, float]] = deque()  # (time, total in flight) of the window
        self.down: deque[tuple[float, int]] = deque()  # (time, count that would do) over the delay
        self.since = now  # the window counts from here
        self.down_since = now  # the scale-down delay counts from here (kept across a scale-down)
        self.last = ""  # what the last look found: shown by ListDeployments
        self.decided = ""  # the last decision's message, shown with what follows it
        self.per_engine = 0.0  # the load of the last full window, per serving engine (a metric)
        self.held = False  # the last look found the deployment held (a change, a rollout)

    def restart(self, now: float, keep_down: bool = False) -> None:
        """Forget the samples (after a change, or while held by a rollout). After a scale-down the
        counts the delay has seen stay valid (they do not depend on the serving count)."""
        self.samples.clear()
        self.since = now
        if not keep_down:
            self.down.clear()
            self.down_since = now

    def step(self, now: float, count: int, total_in_flight: float) -> Decision | None:
        p = self.policy
        if count < p.min or count > p.max:
            new = min(max(count, p.min), p.max)
            self.restart(now)
            return self._decision(count, new, f"outside autoscaling min {p.min} .. max {p.max}")
        self.samples.append((now, total_in_flight))
        while self.samples[0][0] <= now - WINDOW_S:
            self.samples.popleft()
        if now - self.since < WINDOW_S - 1:
            return self._while_gathering(now, count)
        load = statistics.median_low([v for _, v in self.samples])
        self.per_engine = load / count
        figures = f"in flight {load / count:.1f} per engine over {WINDOW_S:.0f} s against a target of {p.target:g}"
        fast = statistics.median_low(self._latest(now, FAST_S))
        overloaded = self._overloaded(now, count)
        if count < p.max and (load > UP_TOLERANCE * p.target * count or overloaded):
            # Sized by the latest part of the window: under a queue that grows (engines saturated)
            # the window's median lags the load, and a step sized by it would be the first of several.
            recent = max(statistics.median_low(self._latest(now, WINDOW_S / 2)), fast)
            if recent > load:
                span = FAST_S if recent == fast else WINDOW_S / 2
                figures += f" ({recent / count:.1f} over the last {span:g} s)"
            up = min(p.max, math.ceil(max(load, recent) / p.target - 1e-9))
            self.restart(now)
            return self._decision(count, up, figures)
        enough = max(p.min, math.ceil(load / (p.target * DOWN_RATIO) - 1e-9))
        while self.down and self.down[-1][1] <= enough:
            self.down.pop()  # the highest count over the delay is what is kept (a monotone queue)
        self.down.append((now, enough))
        while self.down[0][0] <= now - p.scale_down_delay_s:
            self.down.popleft()
        keep = self.down[0][1]
        if keep < count and now - self.down_since >= p.scale_down_delay_s:
            self.restart(now, keep_down=True)
            return self._decision(count, keep, figures + f", low for {p.scale_down_delay_s:g} s")
        if count >= p.max and (load > UP_TOLERANCE * p.target * count or overloaded):
            wanted = math.ceil(load / p.target - 1e-9)
            self.last = self.after(f"capped at max {p.max}: {figures}; the load asks for {wanted}")
            return None
        self.last = self.after(
            f"steady: {figures}"
            + (f"; {keep} would do once the load has stayed low for {p.scale_down_delay_s:g} s" if keep < count else "")
        )
        return None

    def _while_gathering(self, now: float, count: int) -> Decision | None:
        """The window refills after a change, but a clear overload is met once it has held FAST_S:
        a step sized by a median that had only just crossed (noise near the target, then the first
        seconds of a load step) is followed by the step the queue needs, not a whole window later
        while the queue grows. Under a steady load no such overload follows a change."""
        p = self.policy
        fast = statistics.median_low(self._latest(now, FAST_S))
        up = min(p.max, math.ceil(fast / p.target - 1e-9))
        if now - self.since >= FAST_S and self._overloaded(now, count) and up > count:
            self.restart(now)
            figures = (
                f"in flight {fast / count:.1f} per engine over the last {FAST_S:g} s against a target of {p.target:g}"
            )
            return self._decision(count, up, figures + " (a clear overload, met before the window refilled)")
        self.last = self.after(f"gathering {WINDOW_S:.0f} s of load since the last change")
        return None

    def _overloaded(self, now: float, count: int) -> bool:
        """A clear overload: every sample of the last FAST_S at FAST_RATIO x the target or more. A
        burst over within two seconds (two high samples of the last three) is not one: met as one,
        it took the group to max."""
        return min(self._latest(now, FAST_S)) >= FAST_RATIO * self.policy.target * count

    def _latest(self, now: float, span: float) -> list[float]:
        """The samples of the last `span` seconds."""
        return [v for t, v in self.samples if t > now - span]

    def after(self, what: str) -> str:
        return f"{self.decided}; {what}" if self.decided else what

    def _decision(self, old: int, new: int, figures: str) -> Decision:
        message = f"{self.group}: {old} -> {new}, {figures}"
        self.last = self.decided = message
        return Decision(self.group, old, new, message)


class Autoscaler:
    """Runs each autoscaled group's GroupScaler once a second on the leader and acts on its
    decisions. Scale-up first promotes READY spares (controller/capacity/spares.py: they serve at once,
    and the deployment's change starts new spares in their place), then the apply of the new
    count starts the rest; scale-down first takes the instances that go (the least loaded) out of
    the routers and stops them (they drain), then applies the lower count. Nothing is decided while a
    change is being made or while the deployment's rollout is not COMPLETE (progressing or
    paused): the count would add instances of a spec under review; the rollout of a count the
    autoscaler set is the exception (it rolls out no new spec)."""

    def __init__(
        self,
        state: ClusterState,
        deployments: Deployments,
        changes: DeploymentWrites,
        rollouts: Rollouts,
        spawn: Callable,
        spares: Spares,
    ):
        # It reads the deployments from their home and changes them as a rollout does (durable first).
        self.state, self.deployments, self.changes = state, deployments, changes
        self.rollouts, self.spawn, self.spares = rollouts, spawn, spares
        self.scalers: dict[tuple[str, str], GroupScaler] = {}
        # (deployment, group, "up" | "down") -> changes made (motor_controller_autoscale_decisions_total)
        self.decisions: dict[tuple[str, str, str], int] = {}

    def tick(self) -> None:
        now = self.state.mono()
        seen = set()
        for name, (deployment, revision) in list(self.deployments.by_name.items()):
            groups = [g for g in deployment.instance_groups if g.HasField("autoscaling")]
            if not groups:
                continue
            scalers = [self._scaler(name, group, now, seen) for group in groups]
            try:
                held = self._held(name)
            except Exception as exc:  # nor does one deployment's failure stop the others'
                for scaler in scalers:
                    scaler.held = False
                    self._failed(name, scaler, exc)
                continue
            for group, scaler in zip(groups, scalers):
                scaler.held = bool(held)
                if held:
                    scaler.restart(now)
                    scaler.last = scaler.after(f"held: {held}")
                    continue
                try:
                    decision = self._look(scaler, now, group)
                    if decision is not None:
                        self._act(name, deployment, revision, decision)
                except Exception as exc:  # one group's failure never stops the others' pass
                    self._failed(name, scaler, exc)
                    continue
                if decision is not None:
                    break  # one change of a deployment at a time: the next tick sees it made
        for key in set(self.scalers) - seen:
            del self.scalers[key]

    def _scaler(self, name: str, group: C.InstanceGroup, now: float, seen: set) -> GroupScaler:
        """The group's scaler, a new one for a new policy."""
        key, policy = (name, group.name), ScalePolicy.of(group.autoscaling)
        seen.add(key)
        scaler = self.scalers.get(key)
        if scaler is None or scaler.policy != policy:
            scaler = self.scalers[key] = GroupScaler(group.name, policy, now)
        return scaler

    def _look(self, scaler: GroupScaler, now: float, group: C.InstanceGroup) -> Decision | None:
        # A P/D pair scales as one (instance i pairs with instance i): on the larger of the
        # prefill group's and the decode group's load.
        load = max(self.in_flight(group.name), self.in_flight(group.pair_with) if group.pair_with else 0)
        return scaler.step(now, group.count, load)

    def _failed(self, name: str, scaler: GroupScaler, exc: Exception) -> None:
        """Said in the group's status every time, logged once per kind of failure (it repeats each second)."""
        what = f"autoscaling failed: {type(exc).__name__}: {exc}"
        if not scaler.last.endswith(what):
            logger.exception("autoscaling %s of %s: %s; the other groups go on", scaler.group, name, what)
        scaler.last = scaler.after(what)
        scaler.restart(self.state.mono())

    def _held(self, name: str) -> str:
        if self.changes.busy:
            return "a deployment change is being made"
        state, reason = self.rollouts.status(name)
        # A rollout of a count the autoscaler set goes on: a load still growing while the added
        # engines load is met now, not once they have loaded and a whole window after. Paused by
        # itself (an added instance the nodes have no room for, past its deadline), it has no
        # new spec under review either: the next decision replaces it. An operator's pause holds.
        # Both are read from the rollout record, so a restarted controller or a new leader agrees.
        own = self.rollouts.autoscaled(name)
        if state == C.ROLLOUT_STATE_PAUSED and (not own or self.rollouts.paused_by_operator(name)):
            return f"the rollout is paused ({reason}): resume or undo it to scale again"
        if state == C.ROLLOUT_STATE_PROGRESSING and not own:
            return "a rollout is in progress"
        return ""

    def in_flight(self, group: str) -> float:
        """Requests in flight on the group's serving READY engines, as their nodes last reported."""
        return sum(
            self.load_of(i)
            for i in list(self.state.instances.values())
            if i.group == group and not i.spare and i.state == READY
        )

    def load_of(self, inst: InstanceRecord) -> float:
        """The instance's engines' requests in flight averaged over their last second (an engine
        server that does not report the average: the count it read last)."""
        st, total = self.state, 0.0
        for slot in st.slots_of(inst.instance_id):
            node = st.nodes.get(slot.node_id) if slot.node_id else None
            kept = node.engines.get(slot.engine_id) if node is not None else None
            if kept is not None:
                engine = reported_engine.message(kept)
                total += engine.in_flight_average if engine.HasField("in_flight_average") else engine.in_flight_requests
        return total

    def _act(self, name: str, deployment: C.Deployment, revision: int, decision: Decision) -> None:
        promoted = []
        if decision.new > decision.old:
            for _ in range(decision.new - decision.old):
                unit = self.spares.promote_to_serve(decision.group, "the load grew")
                if unit is None:
                    break
                promoted.extend(i.instance_id for i in unit)
        elif not self._withdraw(name, decision):
            return
        scaled = C.Deployment()
        scaled.CopyFrom(deployment)
        partner = next((g.pair_with for g in deployment.instance_groups if g.name == decision.group), "")
        for group in scaled.instance_groups:
            if group.name in (decision.group, partner):
                group.count = decision.new
        key = (name, decision.group, "up" if decision.new > decision.old else "down")
        self.decisions[key] = self.decisions.get(key, 0) + 1
        serving = f"; spare {', '.join(promoted)} serves at once" if promoted else ""
        self.state.events.emit(C.EVENT_TYPE_AUTOSCALE, decision.message + serving, deployment=name)
        logger.info("autoscaling %s: %s%s", name, decision.message, serving)
        self.spawn(self._apply(scaled, revision, decision), f"autoscale {decision.group}")

    def _withdraw(self, name: str, decision: Decision) -> bool:
        """Scale-down: take out the instances that go, in one step (durable first; out of the
        routers before their engines stop, which drain), so that the lowered count's apply finds
        exactly those to keep. Those not READY go first, then the least loaded (the fewest
        requests to drain), the newest among equals. False when the store refused it."""
        st = self.state
        serving = [i for i in st.instances.values() if i.group == decision.group and not i.spare]

        def unit(inst: InstanceRecord) -> list[InstanceRecord]:  # with its decode partner, if any
            partner = st.instances.get(inst.paired_instance_id) if inst.paired_instance_id else None
            return [inst] if partner is None else [inst, partner]

        def rank(inst: InstanceRecord) -> tuple:
            members = unit(inst)
            return all(m.state == READY for m in members), sum(map(self.load_of, members)), -index_of(inst)

        going = [m for inst in sorted(serving, key=rank)[: len(serving) - decision.new] for m in unit(inst)]
        why = f"scaled down ({decision.message})"
        try:
            self.changes.step(name, [(i.instance_id, why) for i in going], [])
        except StoreUnavailable as exc:
            self.state.refused(exc)
            return False
        return True

    async def _apply(self, scaled: C.Deployment, revision: int, decision: Decision) -> None:
        def unchanged(_: C.Deployment) -> C.Deployment:
            # The decision was made on `revision`, and `scaled` is that revision's spec: a change
            # applied since (an operator's, waiting for its turn as the decision was made) wins.
            now = self.deployments.by_name.get(scaled.name)
            if now is None or now[1] != revision:
                since = f"revision {now[1]}" if now else "deleted"
                raise FailedPrecondition(f"the deployment changed since the decision on revision {revision} ({since})")
            return scaled

        try:
            await self.changes.apply(scaled, adjust=unchanged, autoscaled=True)
        except Exception as exc:  # the count stays; the next window decides again
            logger.warning("autoscaling %s to %d could not be applied: %s", decision.group, decision.new, exc)
            self.state.events.emit(
                C.EVENT_TYPE_AUTOSCALE, f"{decision.group}: {decision.old} -> {decision.new} not applied: {exc}"
            )

    def keep_counts(self, deployment: C.Deployment) -> C.Deployment:
        """An apply of a file keeps the count the autoscaler reached for a group that stays
        autoscaled (within the file's min .. max): re-applying the same file does not undo it. The
        decode group a P/D pair's prefill group names gets the same count (the pair scales as one)."""
        current = self.deployments.by_name.get(deployment.name)
        if current is None:
            return deployment
        counts = {g.name: g.count for g in current[0].instance_groups if g.HasField("autoscaling")}
        out = C.Deployment()
        out.CopyFrom(deployment)
        by_name = {g.name: g for g in out.instance_groups}
        for group in out.instance_groups:
            if group.name in counts and group.HasField("autoscaling"):
                a = group.autoscaling
                kept = min(max(counts[group.name], a.min or 1), max(a.max, a.min or 1))
                partner = by_name.get(group.pair_with)
                if partner is not None and partner.count == group.count:  # unequal: validation names it
                    partner.count = kept
                group.count = kept
        return out

    def status(self, name: str, deployment: C.Deployment) -> list[C.GroupScale]:
        """Desired vs current and why, per autoscaled group (ListDeployments)."""
        out = []
        for group in deployment.instance_groups:
            if not group.HasField("autoscaling"):
                continue
            current = sum(
                1 for i in self.state.instances.values() if i.group == group.name and not i.spare and i.state == READY
            )
            scaler = self.scalers.get((name, group.name))
            reason = scaler.last if scaler is not None else "waiting for the first window of load"
            if scaler is not None and scaler.held and not self._held(name):
                # The hold ended since the last look (a rollout COMPLETE): say what the next one does.
                reason = scaler.after(f"gathering {WINDOW_S:.0f} s of load since the hold ended")
            out.append(C.GroupScale(group=group.name, desired=group.count, current=current, reason=reason))
        return out
