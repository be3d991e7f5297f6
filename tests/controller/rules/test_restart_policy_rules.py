"""The restart policy, rule by rule: backoff, its reset, the crash-loop window (controller/model/instances.py,
controller/rules/restart_policy.py).

Each test pins a boundary or a message a user relies on (they keep `make mutation` honest)."""

from __future__ import annotations

from controller.model.instances import (
    InstanceRecord,
    Policy,
    on_failure,
)  # fmt: skip
from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T


def record(**kw) -> InstanceRecord:
    return InstanceRecord("p-0", "p", T.ROLE_PREFILL, 2, 1, False, "", "x", **kw)


# ---------------------------------------------------------------- restart policy


def test_policy_from_an_empty_proto_takes_the_defaults():
    assert Policy.from_proto(C.RestartPolicy()) == Policy(
        group_scope=True, initial_backoff=1.0, max_backoff=60.0, reset_after=600.0, max_failures=5, failure_window=600.0
    )


def test_policy_from_proto_keeps_every_value_given():
    p = C.RestartPolicy(scope=C.RESTART_SCOPE_RANK, max_failures=3)
    p.initial_backoff.FromNanoseconds(1_500_000_000)
    p.max_backoff.FromNanoseconds(30_250_000_000)
    p.reset_after.FromNanoseconds(300_000_000_000)
    p.failure_window.FromNanoseconds(120_000_000_000)
    assert Policy.from_proto(p) == Policy(
        group_scope=False,
        initial_backoff=1.5,
        max_backoff=30.25,
        reset_after=300.0,
        max_failures=3,
        failure_window=120.0,
    )
    assert Policy.from_proto(C.RestartPolicy(scope=C.RESTART_SCOPE_GROUP)).group_scope


POLICY = Policy(initial_backoff=1, max_backoff=60, max_failures=10, failure_window=100, reset_after=50)


def test_healthy_for_exactly_reset_after_starts_the_backoff_over():
    r = record()
    assert [on_failure(r, POLICY, t).delay for t in (0.0, 1.0, 2.0)] == [0, 1, 2]
    r.healthy_since = 10.0
    decision = on_failure(r, POLICY, 60.0)  # healthy for exactly 50 s
    assert not decision.give_up and decision.delay == 0
    r.healthy_since = None  # (the restart's transition clears it)
    assert on_failure(r, POLICY, 61.0).delay == 1  # and doubles again from the start


def test_healthy_for_less_than_reset_after_keeps_the_backoff():
    r = record()
    for t in (0.0, 1.0):
        on_failure(r, POLICY, t)
    r.healthy_since = 30.0
    assert on_failure(r, POLICY, 60.0).delay == 2  # healthy for 30 s only


def test_a_failure_exactly_one_window_old_is_forgotten():
    policy = Policy(initial_backoff=1, max_backoff=60, max_failures=2, failure_window=100, reset_after=1000)
    r = record()
    on_failure(r, policy, 0.0)
    decision = on_failure(r, policy, 100.0)
    assert decision == type(decision)(give_up=False, delay=1, failures_in_window=1)
    assert on_failure(r, policy, 150.0).give_up
