"""Judging an engine's health from its GetStatus answers (no gRPC here: plain, testable logic).

Every heartbeat interval the node manager asks GetStatus with a deadline:
- NORMAL resets the count of consecutive abnormal heartbeats;
- ABNORMAL, or no answer, counts;
- INIT is allowed during the start-up grace, then counts;
- before the engine server has ever answered, no answer during the start-up grace is allowed
  too (the process is still loading and has not bound its management port).
At `threshold` consecutive abnormal heartbeats the engine is to be killed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from motor.v1 import types_pb2

NORMAL = types_pb2.HEALTH_STATUS_NORMAL
INIT = types_pb2.HEALTH_STATUS_INIT
ABNORMAL = types_pb2.HEALTH_STATUS_ABNORMAL
UNKNOWN = types_pb2.HEALTH_STATUS_UNSPECIFIED


@dataclass
class Verdict:
    health: int  # what to show as the engine's health
    reason: str
    counted: bool  # this heartbeat counted as abnormal
    kill: bool  # the threshold was reached: the engine is to be killed
    consecutive: int = 0  # abnormal heartbeats in a row, this one included
    kill_reason: str = ""  # set with `kill`: the reason to kill, with the streak's reasons


@dataclass
class HealthJudge:
    threshold: int
    startup_grace: float
    consecutive: int = 0
    ever_answered: bool = False
    reasons: list[str] = field(default_factory=list)  # reasons of the current abnormal streak

    def judge(self, status: types_pb2.EngineStatus | None, error: str, age: float) -> Verdict:
        """`status` is the answer (None when there was none, `error` says why); `age` is the time
        since the engine was launched."""
        in_grace = age < self.startup_grace
        if status is None:
            if not self.ever_answered and in_grace:
                return self._ok(UNKNOWN, f"engine server not answering yet (starting): {error}")
            return self._abnormal(UNKNOWN, f"no answer: {error}")
        self.ever_answered = True
        reason = status.reason
        if status.status == NORMAL:
            return self._ok(NORMAL, reason or "normal")
        if status.status == INIT:
            if in_grace:
                return self._ok(INIT, reason or "starting", reset=False)
            return self._abnormal(
                INIT, f"still INIT after the {self.startup_grace:g}s start-up grace: {reason or 'starting'}"
            )
        if status.status == ABNORMAL:
            return self._abnormal(ABNORMAL, f"ABNORMAL: {reason or 'no reason given'}")
        return self._abnormal(UNKNOWN, f"unknown status {status.status}: {reason}")

    def _ok(self, health: int, reason: str, reset: bool = True) -> Verdict:
        if reset:
            self.consecutive = 0
            self.reasons.clear()
        return Verdict(health, reason, counted=False, kill=False, consecutive=self.consecutive)

    def _abnormal(self, health: int, reason: str) -> Verdict:
        self.consecutive += 1
        self.reasons.append(reason)
        del self.reasons[: -self.threshold]
        kill = self.consecutive >= self.threshold
        return Verdict(
            health,
            reason,
            counted=True,
            kill=kill,
            consecutive=self.consecutive,
            kill_reason=self.kill_reason() if kill else "",
        )

    def kill_reason(self) -> str:
        return f"killed after {self.consecutive} abnormal heartbeats: {summarize(self.reasons)}"


def summarize(reasons: list[str]) -> str:
    """Collapse repeats: ['a', 'a', 'b'] -> 'a x2; b'."""
    parts: list[tuple[str, int]] = []
    for reason in reasons:
        if parts and parts[-1][0] == reason:
            parts[-1] = (reason, parts[-1][1] + 1)
        else:
            parts.append((reason, 1))
    return "; ".join(f"{r} x{n}" if n > 1 else r for r, n in parts)
