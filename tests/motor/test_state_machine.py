"""The shared state-machine table (motor/state_machine.py): one shape for the tables whose caller
names the next state and for the event-driven one, one error with one message."""

import pytest

from motor.state_machine import IllegalTransition, Transitions

NAMES = {1: "ONE", 2: "TWO", 3: "THREE", None: "new"}


def test_a_table_of_next_states_allows_only_its_moves_and_names_both_states_and_the_reason():
    table = Transitions.between({None: {1}, 1: {1, 2}, 2: set()}, NAMES.get)
    table.check("thing t", None, 1)
    table.check("thing t", 1, 1)
    table.check("thing t", 1, 2)
    with pytest.raises(IllegalTransition, match=r"^thing t: TWO -> ONE is not allowed \(no way back\)$"):
        table.check("thing t", 2, 1, "no way back")
    with pytest.raises(IllegalTransition, match=r"^thing t: new -> TWO is not allowed$"):
        table.check("thing t", None, 2)
    with pytest.raises(IllegalTransition, match=r"^thing t: THREE -> ONE is not allowed$"):
        table.check("thing t", 3, 1)  # a state the table does not list has no moves


def test_an_event_table_gives_the_next_state_or_none_where_the_event_means_nothing():
    table = Transitions({1: {"up": 2, "die": 3}, 2: {"die": 3}}, NAMES.get)
    assert table.next(1, "up") == 2 and table.next(2, "die") == 3
    assert table.next(2, "up") is None and table.next(3, "die") is None


def test_the_error_is_a_runtime_error_a_caller_can_catch_as_a_bug():
    assert issubclass(IllegalTransition, RuntimeError)
