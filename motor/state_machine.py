"""The one shape every state machine's table has, and the one error a forbidden change raises.

A table lists, for each state, the moves out of it: `trigger -> next state`. A machine whose
caller names the state it wants (the controller's instances and nodes, the node manager's
engines) uses the next state as its own trigger (`Transitions.between`) and asks `check`; one
driven by events (the engine server's health) names the event and asks `next`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Generic, TypeVar

S = TypeVar("S", bound=Hashable)
K = TypeVar("K", bound=Hashable)


class IllegalTransition(RuntimeError):
    """A change of state the machine's table does not allow (a bug in the caller)."""


class Transitions(Generic[S, K]):
    def __init__(self, moves: Mapping[S, Mapping[K, S]], name: Callable[[S], str]):
        self.moves, self.name = moves, name

    @classmethod
    def between(cls, follows: Mapping[S, Iterable[S]], name: Callable[[S], str]) -> Transitions[S, S]:
        """A table of which state may follow which."""
        return cls({state: {after: after for after in afters} for state, afters in follows.items()}, name)

    def next(self, state: S, trigger: K) -> S | None:
        """The state `trigger` leads to from `state`; None where the table has no such move."""
        return self.moves.get(state, {}).get(trigger)

    def check(self, what: str, old: S, new: S, reason: str = "") -> None:
        """IllegalTransition naming `what` and both states unless `new` may follow `old`."""
        if self.next(old, new) is None:  # type: ignore[arg-type]
            because = f" ({reason})" if reason else ""
            raise IllegalTransition(f"{what}: {self.name(old)} -> {self.name(new)} is not allowed{because}")
