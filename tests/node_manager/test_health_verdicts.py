"""HealthJudge: the whole verdict (health shown, reason, counted, kill) of each kind of answer.

Written to kill the mutants `make mutation` found surviving (plain logic, no processes)."""

import pytest

from motor.v1 import types_pb2
from node_manager.health import ABNORMAL, INIT, NORMAL, UNKNOWN, HealthJudge, Verdict

GRACE = 10.0


def answer(value: int, reason: str = "") -> types_pb2.EngineStatus:
    return types_pb2.EngineStatus(status=value, reason=reason)


def answered_judge() -> HealthJudge:
    judge = HealthJudge(threshold=3, startup_grace=GRACE)
    judge.judge(answer(NORMAL), "", 1)
    return judge


def ok(health: int, reason: str) -> Verdict:
    return Verdict(health, reason, counted=False, kill=False, consecutive=0)


def counted(health: int, reason: str) -> Verdict:
    """The first abnormal heartbeat of a streak (threshold 3: no kill yet)."""
    return Verdict(health, reason, counted=True, kill=False, consecutive=1)


@pytest.mark.parametrize(
    "status, error, age, expected",
    [
        (answer(NORMAL, "serving"), "", 20, ok(NORMAL, "serving")),
        (answer(NORMAL), "", 20, ok(NORMAL, "normal")),
        (answer(INIT, "loading weights"), "", 5, ok(INIT, "loading weights")),
        (answer(INIT), "", 5, ok(INIT, "starting")),
        # The grace ends at its bound: INIT at exactly 10 s counts.
        (answer(INIT), "", GRACE, counted(INIT, "still INIT after the 10s start-up grace: starting")),
        (answer(INIT, "loading"), "", 11, counted(INIT, "still INIT after the 10s start-up grace: loading")),
        (answer(ABNORMAL, "probe failed x3"), "", 20, counted(ABNORMAL, "ABNORMAL: probe failed x3")),
        (answer(ABNORMAL), "", 20, counted(ABNORMAL, "ABNORMAL: no reason given")),
        (
            answer(7, "from a newer engine server"),
            "",
            20,
            counted(UNKNOWN, "unknown status 7: from a newer engine server"),
        ),
        (None, "GetStatus timed out after 1s", 5, counted(UNKNOWN, "no answer: GetStatus timed out after 1s")),
    ],
)
def test_verdict_of_each_answer_once_the_engine_server_has_answered(status, error, age, expected):
    assert answered_judge().judge(status, error, age) == expected


def test_silence_before_the_first_answer():
    judge = HealthJudge(threshold=3, startup_grace=GRACE)
    assert judge.judge(None, "connection refused", 1) == ok(
        UNKNOWN, "engine server not answering yet (starting): connection refused"
    )
    assert judge.judge(None, "connection refused", GRACE) == counted(UNKNOWN, "no answer: connection refused")


def test_init_within_the_grace_neither_counts_nor_clears_a_streak():
    judge = answered_judge()
    judge.judge(answer(ABNORMAL, "x"), "", 2)
    assert judge.judge(answer(INIT), "", 3) == Verdict(INIT, "starting", counted=False, kill=False, consecutive=1)
    assert judge.consecutive == 1 and judge.reasons == ["ABNORMAL: x"]
    judge.judge(answer(NORMAL), "", 4)
    assert judge.consecutive == 0 and judge.reasons == []


def test_the_threshold_kills_and_keeps_the_last_reasons():
    judge = answered_judge()
    verdicts = [judge.judge(answer(ABNORMAL, f"r{i}"), "", 20) for i in range(4)]
    assert [v.kill for v in verdicts] == [False, False, True, True]
    assert verdicts[2] == Verdict(
        ABNORMAL,
        "ABNORMAL: r2",
        counted=True,
        kill=True,
        consecutive=3,
        kill_reason=("killed after 3 abnormal heartbeats: ABNORMAL: r0; ABNORMAL: r1; ABNORMAL: r2"),
    )
    assert judge.reasons == ["ABNORMAL: r1", "ABNORMAL: r2", "ABNORMAL: r3"]
    assert judge.kill_reason() == "killed after 4 abnormal heartbeats: ABNORMAL: r1; ABNORMAL: r2; ABNORMAL: r3"
