"""The instance records and their state machine, rule by rule (controller/model/instances.py).

Each test pins a boundary or a message a user relies on (they keep `make mutation` honest)."""

from __future__ import annotations

import gc
import json

import pytest

from controller.model.instances import (
    FAILED,
    PENDING,
    READY,
    STARTING,
    IllegalTransition,
    InstanceRecord,
    transition,
)  # fmt: skip
from motor.v1 import types_pb2 as T


def record(**kw) -> InstanceRecord:
    return InstanceRecord("p-0", "p", T.ROLE_PREFILL, 2, 1, False, "", "x", **kw)


# ---------------------------------------------------------------- instance records and transitions


def test_a_record_survives_its_stored_form_and_ignores_unknown_keys():
    r = record(
        state=READY, reason="all NORMAL", restarts=2, failure_times=(1.0, 2.0), restart_ranks=(0, 1), healthy_since=3.0
    )
    stored = json.loads(json.dumps(r.to_dict()))  # as the store keeps it
    assert (
        stored["reason"] == "all NORMAL" and stored["failure_times"] == [1.0, 2.0] and stored["restart_ranks"] == [0, 1]
    )
    again = InstanceRecord.from_dict(stored)
    assert again == r  # tuples again: the garbage collector does not track them
    gc.collect()
    assert not gc.is_tracked(again.failure_times) and not gc.is_tracked(again.restart_ranks)
    # A key written by another version of the controller is ignored, not an error.
    assert InstanceRecord.from_dict({**stored, "written_by_a_newer_controller": 1}) == r


def test_bad_transitions_say_what_was_refused():
    with pytest.raises(ValueError, match=r"^every transition needs a reason$"):
        transition(record(), STARTING, "", 0)
    with pytest.raises(IllegalTransition, match=r"^p-0: FAILED -> READY is not allowed \(no path\)$"):
        transition(record(state=FAILED), READY, "no path", 0)


def test_a_new_reason_in_the_same_state_is_kept_but_is_not_a_state_change():
    r = record(state=STARTING, reason="placed", state_changed_at=1.0)
    assert not transition(r, STARTING, "2 of 3 ranks NORMAL", 5.0)
    assert r.reason == "2 of 3 ranks NORMAL" and r.state_changed_at == 1.0


def test_a_new_state_with_the_same_reason_text_is_a_change():
    r = record(state=PENDING, reason="same words")
    assert transition(r, STARTING, "same words", 2.0)
    assert r.state == STARTING and r.state_changed_at == 2.0


def test_only_ready_starts_the_healthy_clock():
    r = record()
    transition(r, STARTING, "placed", 1.0)
    assert r.healthy_since is None
    transition(r, READY, "all NORMAL", 2.0)
    assert r.healthy_since == 2.0
