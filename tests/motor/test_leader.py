"""Following the leading controller (motor/leader.py): which address a node manager or motorctl
calls next after a failure, and the short backoff while a failover is under way."""

from __future__ import annotations

import grpc
import pytest

from motor.leader import (
    ELECTION_METADATA,
    ELECTION_PATIENCE,
    FOLLOW_RETRY_BASE,
    LEADER_METADATA,
    SUSPECT_FOR,
    ControllerAddresses,
    backoff_delay,
    parse_addresses,
)


class Refusal(grpc.RpcError):
    """What a controller's refusal looks like to a client: a code and trailing metadata."""

    def __init__(self, code: grpc.StatusCode, **trailers: str):
        self._code, self._trailers = code, tuple(trailers.items())

    def code(self) -> grpc.StatusCode:
        return self._code

    def trailing_metadata(self):
        return self._trailers


A, B, C = "10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"


def test_a_refusal_naming_the_leader_goes_there_even_one_not_listed():
    addresses = ControllerAddresses([A, B])
    assert addresses.after_failure(Refusal(grpc.StatusCode.UNAVAILABLE, **{LEADER_METADATA: B}))
    assert addresses.current == B
    assert addresses.after_failure(Refusal(grpc.StatusCode.UNAVAILABLE, **{LEADER_METADATA: C}))
    assert addresses.current == C and addresses.addresses == [A, B, C]


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_an_unreachable_or_silent_controller_is_left_for_the_next(code):
    addresses = ControllerAddresses([A, B])
    assert addresses.after_failure(Refusal(code)) and addresses.current == B
    assert addresses.after_failure(Refusal(code)) and addresses.current == A


def test_a_leader_that_just_failed_to_answer_is_not_followed_back():
    """A paused leader: its call timed out, and the standby still names it until its lease is
    gone; the caller stays on the standby (which is about to lead) instead of going back."""
    now = [100.0]
    addresses = ControllerAddresses([A, B], clock=lambda: now[0])
    assert addresses.after_failure(Refusal(grpc.StatusCode.DEADLINE_EXCEEDED)) and addresses.current == B
    named_a = Refusal(grpc.StatusCode.UNAVAILABLE, **{LEADER_METADATA: A})
    assert not addresses.after_failure(named_a) and addresses.current == B
    now[0] += SUSPECT_FOR
    assert addresses.after_failure(named_a) and addresses.current == A, "followed again once the failure is old"


def test_a_leader_named_by_an_address_the_caller_cannot_reach():
    """motorctl on the host of the compose simulation, given both published ports: the standby
    names the leader by its in-network name, which does not resolve; the other port is tried."""
    host_1, host_2, inside = "localhost:50051", "localhost:50061", "controller-b:50051"
    addresses = ControllerAddresses([host_1, host_2])
    named = Refusal(grpc.StatusCode.UNAVAILABLE, **{LEADER_METADATA: inside})
    assert addresses.after_failure(named) and addresses.current == inside
    assert addresses.after_failure(Refusal(grpc.StatusCode.UNAVAILABLE)) and addresses.current == host_1
    assert addresses.after_failure(named) and addresses.current == host_2


def test_other_errors_and_a_single_address_stay():
    addresses = ControllerAddresses([A, B])
    assert not addresses.after_failure(Refusal(grpc.StatusCode.INVALID_ARGUMENT)) and addresses.current == A
    single = ControllerAddresses([A])
    assert not single.after_failure(Refusal(grpc.StatusCode.UNAVAILABLE)) and single.current == A


def test_a_controller_in_an_election_is_asked_again_but_not_forever():
    """It answered, so it is alive and about to lead or learn who does; one that keeps saying so
    (cut off from etcd) is left after ELECTION_PATIENCE answers."""
    addresses = ControllerAddresses([A, B])
    electing = Refusal(grpc.StatusCode.UNAVAILABLE, **{ELECTION_METADATA: "under way"})
    for _ in range(ELECTION_PATIENCE - 1):
        assert not addresses.after_failure(electing) and addresses.current == A
    assert addresses.after_failure(electing) and addresses.current == B
    assert not addresses.after_failure(electing) and addresses.current == B, "the count starts again"


def test_the_follow_backoff_starts_short_and_is_capped():
    assert all(0 <= backoff_delay(1, FOLLOW_RETRY_BASE, 0.5) <= FOLLOW_RETRY_BASE for _ in range(200))
    assert all(0 <= backoff_delay(30, FOLLOW_RETRY_BASE, 0.5) <= 0.5 for _ in range(200))
    assert max(backoff_delay(30, FOLLOW_RETRY_BASE, 0.5) for _ in range(200)) > FOLLOW_RETRY_BASE


def test_addresses_are_checked_and_named():
    assert parse_addresses(f" {A}, {B} ", "--controller") == [A, B]
    with pytest.raises(ValueError, match="--controller: 'nohost' is not host:port"):
        parse_addresses("nohost", "--controller")
