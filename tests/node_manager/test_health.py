"""HealthJudge: what counts as an abnormal heartbeat (plain logic, no processes)."""

from motor.v1 import types_pb2
from node_manager.health import HealthJudge, summarize


def status(value: int, reason: str = "") -> types_pb2.EngineStatus:
    return types_pb2.EngineStatus(status=value, reason=reason)


NORMAL = status(types_pb2.HEALTH_STATUS_NORMAL, "ok")
INIT = status(types_pb2.HEALTH_STATUS_INIT, "loading")
ABNORMAL = status(types_pb2.HEALTH_STATUS_ABNORMAL, "probe failed x3")


def test_threshold_of_consecutive_abnormal_kills_and_normal_resets():
    judge = HealthJudge(threshold=3, startup_grace=10)
    assert not judge.judge(ABNORMAL, "", 20).kill
    assert not judge.judge(None, "GetStatus timed out after 1s", 20).kill
    assert judge.consecutive == 2
    assert not judge.judge(NORMAL, "", 20).counted
    assert judge.consecutive == 0
    for _ in range(2):
        assert not judge.judge(None, "GetStatus timed out after 1s", 20).kill
    verdict = judge.judge(ABNORMAL, "", 20)
    assert verdict.kill
    assert judge.kill_reason() == (
        "killed after 3 abnormal heartbeats: no answer: GetStatus timed out after 1s x2; ABNORMAL: probe failed x3"
    )


def test_init_and_silence_allowed_during_the_startup_grace_only():
    judge = HealthJudge(threshold=2, startup_grace=10)
    # Not answering yet while loading: allowed during the grace.
    assert not judge.judge(None, "connection refused", 1).counted
    assert not judge.judge(INIT, "", 2).counted
    # Once it has answered, silence counts even during the grace (a hang while loading).
    assert judge.judge(None, "GetStatus timed out", 3).counted
    judge = HealthJudge(threshold=2, startup_grace=10)
    assert not judge.judge(INIT, "", 9).counted
    verdict = judge.judge(INIT, "loading", 11)
    assert verdict.counted and "start-up grace" in verdict.reason
    assert judge.judge(None, "connection refused", 12).kill


def test_summarize_collapses_repeats():
    assert summarize(["a", "a", "b", "a"]) == "a x2; b; a"
