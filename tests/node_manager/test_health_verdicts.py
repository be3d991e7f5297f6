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


@pytest.mark.parametrize(
    "status, error, age, expected",
    [
        (answer(NORMAL, "serving"), "", 20, Verdict(NORMAL, "serving", counted=False, kill=False)),
        (answer(NORMAL), "", 20, Verdict(NORMAL, "normal", counted=False, kill=False)),
        (answer(INIT, "loading weights"), "", 5, Verdict(INIT, "loading weights", counted=False, kill=False)),
        (answer(INIT), "", 5, Verdict(INIT, "starting", counted=False, kill=False)),
        # The grace ends at its bound: INIT at exactly 10 s counts.
        (answer(INIT), "", GRACE, Verdict(INIT, "still INIT after the 10s start-up grace: starting", counted=True, kill=False)),
        (answer(INIT, "loading"), "", 11, Verdict(INIT, "still INIT after the 10s start-up grace: loading", counted=True, kill=False)),
        (answer(ABNORMAL, "probe failed x3"), "", 20, Verdict(ABNORMAL, "ABNORMAL: probe failed x3", counted=True, kill=False)),
        (answer(ABNORMAL), "", 20, Verdict(ABNORMAL, "ABNORMAL: no reason given", counted=True, kill=False)),
        (answer(7, "from a newer engine server"), "", 20,
         Verdict(UNKNOWN, "unknown status 7: from a newer engine server", counted=True, kill=False)),
        (None, "GetStatus timed out after 1s", 5, Verdict(UNKNOWN, "no answer: GetStatus timed out after 1s", counted=True, kill=False)),
    ],
)  # fmt: skip
def test_verdict_of_each_answer_once_the_engine_server_has_answered(status, error, age, expected):
    assert answered_judge().judge(status, error, age) == expected


def test_silence_before_the_first_answer():
    judge = HealthJudge(threshold=3, startup_grace=GRACE)
    assert judge.judge(None, "connection refused", 1) == Verdict(
        UNKNOWN, "engine server not answering yet (starting): connection refused", counted=False, kill=False
    )
    assert judge.judge(None, "connection refused", GRACE) == Verdict(
        UNKNOWN, "no answer: connection refused", counted=True, kill=False
    )


def test_init_within_the_grace_neither_counts_nor_clears_a_streak():
    judge = answered_judge()
    judge.judge(answer(ABNORMAL, "x"), "", 2)
    assert judge.judge(answer(INIT), "", 3) == Verdict(INIT, "starting", counted=False, kill=False)
    assert judge.consecutive == 1 and judge.reasons == ["ABNORMAL: x"]
    judge.judge(answer(NORMAL), "", 4)
    assert judge.consecutive == 0 and judge.reasons == []


def test_the_threshold_kills_and_keeps_the_last_reasons():
    judge = answered_judge()
    verdicts = [judge.judge(answer(ABNORMAL, f"r{i}"), "", 20) for i in range(4)]
    assert [v.kill for v in verdicts] == [False, False, True, True]
    assert verdicts[2] == Verdict(ABNORMAL, "ABNORMAL: r2", counted=True, kill=True)
    assert judge.reasons == ["ABNORMAL: r1", "ABNORMAL: r2", "ABNORMAL: r3"]
    assert judge.kill_reason() == "killed after 4 abnormal heartbeats: ABNORMAL: r1; ABNORMAL: r2; ABNORMAL: r3"
