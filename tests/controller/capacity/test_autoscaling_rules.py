"""The autoscaling block of an instance group: validation (errors name the field as the file spells
it) and the decisions of controller/capacity/autoscaler.py on a fake clock with fed load series."""

from __future__ import annotations

import bisect
import random

import pytest

from controller.capacity.autoscaler import GroupScaler, ScalePolicy
from controller.rules.deployment_checks import validate_deployment
from engine_server.load_meter import SAMPLE_PERIOD, InFlightMeter
from motor.errors import InvalidArgument
from tests.support.controller_harness import small_deployment


def invalid(deployment, **limits) -> str:
    with pytest.raises(InvalidArgument) as err:
        validate_deployment(deployment, **limits)
    return str(err.value)


def union(**group) -> list[dict]:
    return [{"name": "chat", "role": "union", **group}]


# ---------------------------------------------------------------- the block in a file


def test_a_valid_block_gets_its_defaults():
    d = validate_deployment(small_deployment(union(count=2, autoscaling={"max": 8, "target_in_flight": 4})))
    a = d.instance_groups[0].autoscaling
    assert (a.min, a.max, a.target_in_flight, a.scale_down_delay_s) == (1, 8, 4, 300)


def test_count_outside_min_and_max_is_refused_naming_the_fields():
    message = invalid(small_deployment(union(count=9, autoscaling={"min": 2, "max": 8, "target_in_flight": 4})))
    assert "instance_groups[0].count: 9 is outside autoscaling min 2 .. max 8" in message
    message = invalid(small_deployment(union(count=1, autoscaling={"min": 2, "max": 8, "target_in_flight": 4})))
    assert "instance_groups[0].count: 1 is outside autoscaling min 2 .. max 8" in message


def test_max_below_min_missing_target_and_negative_delay_are_each_named():
    message = invalid(small_deployment(union(count=3, autoscaling={"min": 3, "max": 2, "scale_down_delay_s": -1})))
    assert "instance_groups[0].autoscaling.max: required, at least min (3)" in message
    assert "instance_groups[0].autoscaling.target_in_flight: required: a positive number" in message
    assert "instance_groups[0].autoscaling.scale_down_delay_s: must not be negative" in message


def test_the_engine_limit_counts_max_and_spares():
    deployment = small_deployment(union(count=1, spares=1, autoscaling={"max": 8, "target_in_flight": 4}))
    validate_deployment(deployment, max_engines=9)
    assert "9 engines" in invalid(deployment, max_engines=8)


def test_a_pd_pair_autoscales_through_its_prefill_group_and_counts_both_in_the_engine_limit():
    groups = [
        {"name": "p", "role": "prefill", "pair_with": "d", "autoscaling": {"max": 4, "target_in_flight": 4}},
        {"name": "d", "role": "decode"},
    ]
    validate_deployment(small_deployment(groups), max_engines=8)
    assert "8 engines" in invalid(small_deployment(groups), max_engines=7)
    groups[1]["autoscaling"] = {"max": 4, "target_in_flight": 4}
    assert "instance_groups[1].autoscaling: decode group 'd' is paired with prefill group 'p'" in invalid(
        small_deployment(groups)
    )


# ---------------------------------------------------------------- decisions on a fake clock

POLICY = ScalePolicy(min=1, max=8, target=4.0, scale_down_delay_s=300.0)


def run(scaler: GroupScaler, count: int, load, seconds: int, start: float = 0.0) -> tuple[int, list]:
    """Feed one sample a second (`load(t)`: total requests in flight of the group); apply each
    decision at once. Returns the final count and the decisions as (time, old, new)."""
    decisions = []
    for t in range(int(start), int(start + seconds)):
        decision = scaler.step(float(t), count, load(t))
        if decision is not None:
            decisions.append((t, decision.old, decision.new))
            count = decision.new
    return count, decisions


def test_a_tripled_load_adds_the_engines_it_needs_in_one_step_within_the_window():
    scaler = GroupScaler("chat", POLICY, now=0.0)
    count, decisions = run(scaler, 2, lambda t: 8 if t < 60 else 24, 120)
    assert count == 6
    assert len(decisions) == 1
    t, old, new = decisions[0]
    assert (old, new) == (2, 6) and 60 < t <= 71


def test_a_load_within_a_tenth_above_the_target_adds_no_engine():
    # A load that sits on the target wanders a little above it: only more than 10 % above it adds
    # an engine (the tolerance Kubernetes' HPA keeps), so it is not added and taken back each time.
    policy = ScalePolicy(min=1, max=5, target=1.5, scale_down_delay_s=300.0)
    assert run(GroupScaler("chat", policy, now=0.0), 1, lambda t: 1.6, 120) == (1, [])
    assert run(GroupScaler("chat", policy, now=0.0), 2, lambda t: 3.2, 120) == (2, [])
    count, decisions = run(GroupScaler("chat", policy, now=0.0), 1, lambda t: 1.7, 120)
    assert count == 2 and len(decisions) == 1, decisions


def test_the_decision_says_its_figures():
    scaler = GroupScaler("chat", POLICY, now=0.0)
    decision = next(d for t in range(30) if (d := scaler.step(float(t), 2, 11.6)) is not None)
    assert decision.message == "chat: 2 -> 3, in flight 5.8 per engine over 10 s against a target of 4"


def test_steps_stay_within_min_and_max():
    scaler = GroupScaler("chat", POLICY, now=0.0)
    assert run(scaler, 2, lambda t: 1000, 30)[0] == 8
    scaler = GroupScaler("chat", POLICY, now=0.0)
    assert run(scaler, 3, lambda t: 0, 400)[0] == 1
    scaler = GroupScaler("chat", ScalePolicy(min=2, max=8, target=4.0, scale_down_delay_s=300.0), now=0.0)
    assert run(scaler, 5, lambda t: 0, 400)[0] == 2


def test_scale_down_waits_for_the_load_to_stay_low_for_the_delay():
    scaler = GroupScaler("chat", POLICY, now=0.0)
    count, decisions = run(scaler, 6, lambda t: 4, 299)
    assert (count, decisions) == (6, [])
    count, decisions = run(scaler, 6, lambda t: 4, 20, start=299)
    # 4 in flight: 2 engines keep each below 0.8 x the target (hysteresis), so no scale-up follows.
    assert count == 2 and len(decisions) == 1


def test_a_short_burst_restarts_the_scale_down_delay():
    scaler = GroupScaler("chat", POLICY, now=0.0)
    count, decisions = run(scaler, 6, lambda t: 24 if 200 <= t < 215 else 4, 450)
    assert count == 6 and decisions == [] or decisions[0][0] >= 215 + 300 - 10


def direction_changes(decisions: list) -> int:
    directions = [1 if new > old else -1 for _, old, new in decisions]
    return sum(1 for a, b in zip(directions, directions[1:]) if a != b)


def test_a_noisy_steady_load_changes_direction_at_most_once():
    rng = random.Random(7)
    for mean in (6.0, 10.0, 11.5, 12.0, 13.0, 20.0):
        scaler = GroupScaler("chat", POLICY, now=0.0)
        count, decisions = run(scaler, 3, lambda t: max(0.0, rng.gauss(mean, mean * 0.4)), 3600)
        assert direction_changes(decisions) <= 1, (mean, decisions)


def test_a_random_load_near_the_target_does_not_flap():
    """Requests arriving at random (Poisson), 0.2 s each in an engine, as users send them, read as
    the engines report them (sampled and averaged over time by the engine server's meter). An
    instant's count flapped here: at 1.0 in flight per engine against a target of 1.5 it read 2
    often enough that the window's median scaled up, and down again after the delay."""
    service_s, seconds = 0.2, 3600
    for rate in (3, 5, 6, 7, 8, 10, 12, 15, 18):  # 0.6 .. 3.6 in flight: below, at and above 1.5
        rng, arrivals, t = random.Random(rate), [], 0.0
        while t < seconds:
            t += rng.expovariate(rate)
            arrivals.append(t)
        meter, count, decisions = InFlightMeter(), 1, []
        scaler = GroupScaler("chat", ScalePolicy(min=1, max=5, target=1.5, scale_down_delay_s=300.0), now=0.0)
        per_second = round(1 / SAMPLE_PERIOD)
        for tick in range(seconds * per_second):
            now = tick / per_second
            held = bisect.bisect_right(arrivals, now) - bisect.bisect_right(arrivals, now - service_s)
            meter.add(now, held)
            if tick % per_second == 0:  # the controller's one sample a second
                decision = scaler.step(now, count, meter.average(now, held))
                if decision is not None:
                    decisions.append((now, decision.old, decision.new))
                    count = decision.new
        assert direction_changes(decisions) <= 1, (rate, decisions)


def test_a_new_leader_continues_from_the_persisted_count_without_a_jump():
    scaler = GroupScaler("chat", POLICY, now=1000.0)  # a failover: no history, the stored count 6
    count, decisions = run(scaler, 6, lambda t: 22, 120, start=1000)
    assert (count, decisions) == (6, [])


def test_a_count_below_min_is_raised_at_once():
    scaler = GroupScaler("chat", ScalePolicy(min=3, max=8, target=4.0, scale_down_delay_s=300.0), now=0.0)
    decision = scaler.step(0.0, 1, 0.0)
    assert decision is not None and decision.new == 3


def test_a_queue_growing_on_saturated_engines_is_met_in_one_step():
    # One engine past its capacity: requests in flight grow by 2 a second from the step on.
    scaler = GroupScaler("chat", ScalePolicy(min=1, max=5, target=1.5, scale_down_delay_s=300.0), now=0.0)
    count, decisions = run(scaler, 1, lambda t: 1 if t < 60 else 1 + 2 * (t - 60), 80)
    assert count == 5 and len(decisions) == 1, decisions


def test_a_queue_building_on_one_engine_is_met_within_seconds_not_half_the_window():
    # One engine of capacity 10 requests/s under 30/s: its queue grows by 20 a second from the
    # step on. Waiting for the 10 s window's median to move lets the queue grow for 6 s.
    scaler = GroupScaler("chat", ScalePolicy(min=1, max=5, target=1.5, scale_down_delay_s=300.0), now=0.0)
    count, decisions = run(scaler, 1, lambda t: 1 if t < 60 else 1 + 20 * (t - 60), 80)
    assert count == 5 and len(decisions) == 1, decisions
    assert decisions[0][0] <= 63, decisions  # once it has held FAST_S (3 s): from 61, the first sample above


def test_a_step_sized_by_a_median_that_had_only_just_crossed_is_followed_within_seconds():
    # Noise near the target (the median of ten at 1.55, within the 10 % above it that adds no
    # engine), then a load step whose queue grows 20 a second: the first step, taken when the
    # median crossed, adds one engine; the next must not wait for a whole window while the queue grows.
    scaler = GroupScaler("chat", ScalePolicy(min=1, max=5, target=1.5, scale_down_delay_s=300.0), now=0.0)
    count, decisions = run(scaler, 1, lambda t: (1.55, 1.75)[t % 2] if t < 60 else 20.0 * (t - 59), 80)
    assert [(old, new) for _, old, new in decisions] == [(1, 2), (2, 5)], decisions
    (first, _, _), (second, _, _) = decisions
    assert first == 60 and second - first <= 4
    assert scaler.last.startswith("chat: 2 -> 5, in flight ") and "met before the window refilled" in scaler.last


def test_a_second_step_down_follows_once_the_loads_way_down_has_aged_out():
    # The load falls from 5 engines' worth through 2 engines' worth (20 s) to 1 engine's worth: the
    # first step down (to 2, the highest count the delay saw) is followed by the step to 1 as soon
    # as those 20 s are older than the delay, not after a second whole delay.
    scaler = GroupScaler("chat", POLICY, now=0.0)
    count, decisions = run(scaler, 5, lambda t: 16 if t < 400 else 6 if t < 420 else 2, 1100)
    assert count == 1 and [(old, new) for _, old, new in decisions] == [(5, 2), (2, 1)], decisions
    (first, _, _), (second, _, _) = decisions
    assert 400 + 300 <= first and second - first <= 60, decisions


def test_the_bounds_of_the_block_are_inclusive():
    # min == max, count at max, max at the largest count, a fractional target and delay: all valid
    for block, count in (
        ({"min": 2, "max": 2, "target_in_flight": 4}, 2),
        ({"max": 8, "target_in_flight": 4}, 8),
        ({"max": 10_000, "target_in_flight": 0.5, "scale_down_delay_s": 0.5}, 1),
    ):
        validate_deployment(small_deployment(union(count=count, autoscaling=block)), max_engines=10_000)


def test_the_refusals_say_what_count_means_and_what_the_engine_limit_counted():
    message = invalid(small_deployment(union(count=9, autoscaling={"max": 8, "target_in_flight": 4})))
    assert message.endswith(
        "instance_groups[0].count: 9 is outside autoscaling min 1 .. max 8 (count is the starting count)"
    )
    deployment = small_deployment(union(count=1, autoscaling={"max": 8, "target_in_flight": 4}))
    assert "8 engines (count or autoscaling max x data_parallel_size) exceed" in invalid(deployment, max_engines=7)
    plain = small_deployment(union(count=8))
    assert "8 engines (count x data_parallel_size) exceed" in invalid(plain, max_engines=7)
    groups = [
        {"name": "p", "role": "prefill", "pair_with": "d", "autoscaling": {"max": 4, "target_in_flight": 4}},
        {"name": "d", "role": "decode", "autoscaling": {"max": 4, "target_in_flight": 4}},
    ]
    assert invalid(small_deployment(groups)).endswith(
        "instance_groups[1].autoscaling: decode group 'd' is paired with prefill group 'p' (instance i with "
        "instance i, equal counts): the pair scales as one, so put the autoscaling block on the prefill group "
        "only (or leave out pair_with: unpaired prefill and decode groups each scale on their own load)"
    )


def test_a_target_or_delay_that_is_not_a_finite_number_is_refused_naming_the_field_as_the_file_does():
    # scale_down_delay_s is a duration, written as every duration of the file (30, '30s', '5m').
    for block, expected in (
        (
            {"max": 4, "target_in_flight": 4, "scale_down_delay_s": "30 seconds"},
            "instance_groups[0].autoscaling.scale_down_delay_s: expected a duration (seconds as a number (60) or "
            "with a unit: 500ms, 60s, 5m, 1h), got '30 seconds'",
        ),
        ({"max": 4, "target_in_flight": "four"}, "instance_groups[0].autoscaling.target_in_flight: expected a number"),
        ({"max": 4, "target_in_flight": True}, "instance_groups[0].autoscaling.target_in_flight: expected a number"),
        (
            {"max": 4, "target_in_flight": float("inf")},
            "instance_groups[0].autoscaling.target_in_flight: expected a finite number, got inf",
        ),
        (
            {"max": 4, "target_in_flight": 4, "scale_down_delay_s": float("nan")},
            "instance_groups[0].autoscaling.scale_down_delay_s: expected a duration (seconds as a number (60) or "
            "with a unit: 500ms, 60s, 5m, 1h), got nan",
        ),
    ):
        with pytest.raises(InvalidArgument) as err:
            small_deployment(union(count=1, autoscaling=block))
        assert expected in str(err.value), str(err.value)
    # A quoted number is a string (the file reader reads an unquoted 1e3 as a number)
    with pytest.raises(InvalidArgument, match="a quoted number: write it without quotes, 1e3"):
        small_deployment(union(count=1, autoscaling={"max": 4, "target_in_flight": "1e3"}))


def test_a_count_left_out_below_min_is_refused_saying_it_was_not_given():
    message = invalid(small_deployment(union(autoscaling={"min": 3, "max": 8, "target_in_flight": 4})))
    assert (
        "instance_groups[0].count: not given (1 by default), which is outside autoscaling min 3 .. max 8: give the "
        "starting count" in message
    ), message


def test_a_burst_shorter_than_the_fast_span_does_not_scale_up():
    # A batch of requests lands at once and is served within two seconds: two samples of 25 times
    # the target, the rest of the minute at half of it. The clear overload is one that has held
    # FAST_S (3 s); two samples of the last three are not that.
    scaler = GroupScaler("chat", POLICY, now=0.0)
    count, decisions = run(scaler, 1, lambda t: 100.0 if t in (30, 31) else 2.0, 60)
    assert (count, decisions) == (1, []), decisions


def test_the_target_range_holds_its_bounds_inclusively_and_names_them():
    for target in (0.01, 1_000_000):
        validate_deployment(small_deployment(union(autoscaling={"max": 4, "target_in_flight": target})))
    for target in (0.0099, 1_000_001):
        message = invalid(small_deployment(union(autoscaling={"max": 4, "target_in_flight": target})))
        assert (
            "instance_groups[0].autoscaling.target_in_flight: must be from 0.01 to 1000000 requests in flight "
            f"per engine (got {target:g})"
        ) in message
