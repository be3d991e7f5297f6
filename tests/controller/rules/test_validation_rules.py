"""Deployment validation and expansion, rule by rule: every problem named, limits inclusive, spec hashes
(controller/rules/deployment_checks.py).

Each test pins a boundary or a message a user relies on (they keep `make mutation` honest)."""

from __future__ import annotations

import re

import pytest
from google.protobuf.duration_pb2 import Duration

from controller.rules.deployment_checks import strategy_problems, validate_deployment
from controller.rules.expansion import GroupSpecs, InstanceSpec, expand, integral_numbers
from controller.rules.node_reports import MAX_ENGINES_PER_NODE, check_engine_count
from motor.errors import InvalidArgument, ResourceExhausted
from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T
from tests.support.controller_harness import small_deployment

# ---------------------------------------------------------------- validation


def invalid(deployment, **limits) -> str:
    with pytest.raises(InvalidArgument) as err:
        validate_deployment(deployment, **limits)
    return str(err.value)


def test_every_problem_is_named_in_one_message():
    deployment = small_deployment(
        [{"name": "Bad Name", "role": "union"}, {"name": "u", "role": "union"}, {"name": "u", "role": "union"}],
        name=" ",
        model="",
    )
    assert invalid(deployment) == (
        "invalid deployment: name: required (a name for this deployment, e.g. 'local-sim'); "
        "model: required (the model name or path the engines serve); "
        "instance_groups[0].name: 'Bad Name' must be 1-56 lowercase letters, digits, '.', '_' or '-', "
        "starting with a letter or digit (instances are named '<name>-<index>'); "
        "instance_groups[2].name: 'u' is already the name of instance_groups[1]"
    )
    assert invalid(small_deployment([])) == "invalid deployment: instance_groups: at least one group is required"


def test_size_limits_are_inclusive_and_named():
    largest = {"name": "u", "role": "union", "count": 10_000, "data_parallel_size": 1024, "accelerators_per_engine": 64}
    unlimited = 2**62  # the per-field limits alone; the engines limit has its own test below
    validate_deployment(small_deployment([largest]), max_engines=unlimited)
    too_large = {**largest, "count": 10_001, "data_parallel_size": 1025, "accelerators_per_engine": 65}
    assert invalid(small_deployment([too_large]), max_engines=unlimited) == (
        "invalid deployment: instance_groups[0].count: must be at most 10000 (got 10001); "
        "instance_groups[0].data_parallel_size: must be at most 1024 (got 1025); "
        "instance_groups[0].accelerators_per_engine: must be at most 64 (got 65)"
    )


def test_the_engines_of_a_deployment_are_limited_inclusively_naming_the_setting():
    group = {"name": "u", "role": "union", "count": 50, "data_parallel_size": 4}
    validate_deployment(small_deployment([group]), max_engines=200)
    assert invalid(small_deployment([group]), max_engines=199) == (
        "invalid deployment: instance_groups: 200 engines (count x data_parallel_size) exceed the limit "
        "max_engines_per_deployment=199 (controller setting --max-engines-per-deployment)"
    )


def test_the_engines_one_node_reports_are_limited_inclusively_naming_the_setting():
    check_engine_count("node-a", 10, 10, "engines")  # at the limit: taken
    with pytest.raises(ResourceExhausted) as refused:
        check_engine_count("node-a", 11, 10, "engines")
    assert str(refused.value) == (
        "engines: node node-a reports 11 engines; one node may report at most "
        "max_engines_per_node=10 (controller setting --max-engines-per-node)"
    )
    assert MAX_ENGINES_PER_NODE == 1024


def test_group_defaults():
    group = validate_deployment(small_deployment([{"name": "u", "role": "union"}])).instance_groups[0]
    assert (group.count, group.data_parallel_size, group.accelerators_per_engine) == (1, 1, 1)
    group = validate_deployment(small_deployment([{"name": "u", "role": "union", "count": 3, "data_parallel_size": 2}]))
    assert (group.instance_groups[0].count, group.instance_groups[0].data_parallel_size) == (3, 2)


def test_a_missing_engine_config_section_names_the_group_and_role():
    deployment = small_deployment([{"name": "u", "role": "union"}, {"name": "d", "role": "decode"}])
    del deployment.engine_config.fields["motor_engine_decode_config"]
    assert invalid(deployment) == (
        "invalid deployment: engine_config.motor_engine_decode_config: required by instance_groups[1] (role decode): "
        "the user_config section its engines read"
    )


def test_pairing_problems_are_found_in_every_group():
    unknown = small_deployment([{"name": "u", "role": "union"}, {"name": "p", "role": "prefill", "pair_with": "x"},
                                {"name": "d", "role": "decode"}])  # fmt: skip
    assert invalid(unknown) == (
        "invalid deployment: instance_groups[1].pair_with: 'x' is not a group of this deployment (groups: d, p, u)"
    )
    wrong_role = small_deployment([{"name": "d", "role": "decode", "pair_with": "d"}])
    assert invalid(wrong_role) == (
        "invalid deployment: instance_groups[0].pair_with: only a prefill group pairs with a decode group "
        "(this group's role is decode)"
    )
    counts = small_deployment(
        [{"name": "p", "role": "prefill", "pair_with": "d", "count": 2}, {"name": "d", "role": "decode"}]
    )
    assert invalid(counts) == (
        "invalid deployment: instance_groups[0].pair_with: 'd' has 1 instance(s) and this group 2: "
        "paired groups pair instance i with instance i, so their counts must match"
    )


def test_restart_policy_defaults_are_filled_in_the_stored_deployment():
    p = validate_deployment(small_deployment([{"name": "u", "role": "union"}])).restart_policy
    assert [
        getattr(p, name).ToNanoseconds() for name in ("initial_backoff", "max_backoff", "reset_after", "failure_window")
    ] == [1_000_000_000, 60_000_000_000, 600_000_000_000, 600_000_000_000]
    assert p.max_failures == 5 and p.scope == C.RESTART_SCOPE_GROUP


def test_restart_policy_bounds():
    def policy(**values):
        return small_deployment([{"name": "u", "role": "union"}], restart_policy=values)

    kept = validate_deployment(policy(initial_backoff="0.5s", max_backoff="0.5s", max_failures=3)).restart_policy
    assert kept.initial_backoff.ToNanoseconds() == kept.max_backoff.ToNanoseconds() == 500_000_000
    assert kept.max_failures == 3
    assert invalid(policy(reset_after="0s")) == (
        "invalid deployment: restart_policy.reset_after: must be a positive duration such as '1s' (got 0.0s)"
    )
    assert invalid(policy(failure_window="-0.5s")) == (
        "invalid deployment: restart_policy.failure_window: must be a positive duration such as '1s' (got -0.5s)"
    )
    validate_deployment(policy(initial_backoff="1.5s", max_backoff="2s"))  # fractions count as fractions


# ---------------------------------------------------------------- expansion


def test_expanded_instances_carry_their_group():
    d = validate_deployment(small_deployment([
        {"name": "p", "role": "prefill", "count": 2, "pair_with": "d", "data_parallel_size": 2,
         "accelerators_per_engine": 2, "single_container": True},
        {"name": "d", "role": "decode", "count": 2},
    ]))  # fmt: skip
    instances = expand(d)
    spec = instances["p-1"]
    assert re.fullmatch(r"[0-9a-f]{16}", spec.spec_hash)
    assert spec == InstanceSpec(
        instance_id="p-1",
        group="p",
        role=T.ROLE_PREFILL,
        index=1,
        data_parallel_size=2,
        accelerators_per_engine=2,
        single_container=True,
        paired_instance_id="d-1",
        spec_hash=spec.spec_hash,
    )
    assert instances["d-1"].paired_instance_id == "p-1" and instances["d-0"].index == 0


def spec_hash(engine_args: dict) -> str:
    deployment = small_deployment([{"name": "u", "role": "union"}])
    deployment.engine_config.fields["motor_engine_union_config"].struct_value.update({"engine_args": engine_args})
    return expand(validate_deployment(deployment))["u-0"].spec_hash


def test_the_spec_hash_follows_the_engine_config_section_not_its_key_order():
    assert spec_hash({"latency_ms": 1, "utilization": 2}) == spec_hash({"utilization": 2, "latency_ms": 1})
    assert spec_hash({"latency_ms": 1, "utilization": 2}) != spec_hash({"latency_ms": 1, "utilization": 3})


def test_whole_numbers_of_the_engine_config_are_given_back_as_ints():
    config = {"max_failure_count": 3.0, "ratio": 0.5, "ids": [1.0, 2.5], "name": "x", "on": True,
              "nested": {"port": 8000.0}}  # fmt: skip
    back = integral_numbers(config)
    assert back == {
        "max_failure_count": 3,
        "ratio": 0.5,
        "ids": [1, 2.5],
        "name": "x",
        "on": True,
        "nested": {"port": 8000},
    }
    assert (
        type(back["max_failure_count"]) is int and type(back["nested"]["port"]) is int and type(back["ids"][0]) is int
    )


def test_a_deployment_may_not_choose_the_program_an_engine_runs():
    deployment = small_deployment([{"name": "u", "role": "union"}])
    deployment.engine_config.fields["motor_engine_union_config"].struct_value.update(
        {"engine_args": {"launcher": ["/bin/sh"]}}
    )
    assert invalid(deployment) == (
        "invalid deployment: engine_config.motor_engine_union_config.engine_args.launcher: names the command that "
        "starts SGLang; a request may not choose what runs on a node (engine commands come from the node manager's "
        "--engine-command)"
    )


def test_a_deployment_name_outside_the_id_rule_is_refused_with_the_rule_and_an_example():
    deployment = small_deployment([{"name": "u", "role": "union"}])
    deployment.name = "Chat Large"
    assert invalid(deployment) == (
        "invalid deployment: name: 'Chat Large' must be 1-63 lowercase letters, digits, '.', '_' or '-', "
        "starting with a letter or digit (e.g. 'chat-large')"
    )


# ---------------------------------------------------------------- update strategy and spares

ROLLING, RECREATE = C.UPDATE_STRATEGY_TYPE_ROLLING, C.UPDATE_STRATEGY_TYPE_RECREATE
POSITIVE = "must be a positive duration such as '30s'"


def test_strategy_defaults_are_filled_in_and_given_values_kept():
    defaults = C.UpdateStrategy()
    assert strategy_problems(defaults) == []
    assert (defaults.type, defaults.max_surge, defaults.max_unavailable) == (ROLLING, 1, 0)
    assert defaults.HasField("max_surge") and defaults.HasField("max_unavailable")
    assert (defaults.progress_deadline.seconds, defaults.min_ready.seconds) == (600, 5)
    given = C.UpdateStrategy(
        type=RECREATE, max_surge=3, max_unavailable=2, progress_deadline=Duration(seconds=30), min_ready=Duration()
    )
    assert strategy_problems(given) == []
    assert (given.type, given.max_surge, given.max_unavailable) == (RECREATE, 3, 2)
    assert (given.progress_deadline.seconds, given.min_ready.seconds) == (30, 0)


def test_strategy_durations_are_positive_and_a_progress_deadline_more_than_zero():
    assert strategy_problems(
        C.UpdateStrategy(progress_deadline=Duration(seconds=-1), min_ready=Duration(seconds=-1))
    ) == [
        f"strategy.progress_deadline: {POSITIVE}",
        f"strategy.min_ready: {POSITIVE}",
    ]
    assert strategy_problems(C.UpdateStrategy(progress_deadline=Duration())) == [
        f"strategy.progress_deadline: {POSITIVE}"
    ]
    half = Duration(nanos=500_000_000)
    assert strategy_problems(C.UpdateStrategy(progress_deadline=half, min_ready=half)) == []


def test_a_rolling_strategy_must_be_able_to_move():
    assert strategy_problems(C.UpdateStrategy(max_surge=0, max_unavailable=0)) == [
        "strategy.max_surge: max_surge and max_unavailable are both 0, so a rollout could neither start a new "
        "instance nor stop an old one: set max_surge (extra instances) or max_unavailable (in place)"
    ]
    assert strategy_problems(C.UpdateStrategy(max_surge=0, max_unavailable=1)) == []
    assert strategy_problems(C.UpdateStrategy(type=RECREATE, max_surge=0, max_unavailable=0)) == []


def test_spares_are_limited_inclusively_and_counted_in_the_engines_limit():
    validate_deployment(small_deployment([{"name": "u", "role": "union", "spares": 10_000}]), max_engines=2**62)
    assert invalid(small_deployment([{"name": "u", "role": "union", "spares": 10_001}]), max_engines=2**62) == (
        "invalid deployment: instance_groups[0].spares: must be at most 10000 (got 10001)"
    )
    spared = small_deployment([{"name": "u", "role": "union", "count": 1, "spares": 1}])
    validate_deployment(spared, max_engines=2)
    assert invalid(spared, max_engines=1) == (
        "invalid deployment: instance_groups: 2 engines (count x data_parallel_size, spares included) exceed the "
        "limit max_engines_per_deployment=1 (controller setting --max-engines-per-deployment)"
    )


def test_a_pd_pair_needs_the_same_number_of_spares_on_both_sides():
    pair = [
        {"name": "p", "role": "prefill", "spares": 1, "pair_with": "d"},
        {"name": "d", "role": "decode", "spares": 2},
    ]
    assert invalid(small_deployment(pair)) == (
        "invalid deployment: instance_groups[0].spares: 'd' has 2 spare(s) and this group 1: a P/D pair is "
        "promoted whole, so paired groups need the same number of spares"
    )


def test_the_spares_of_a_group_come_after_its_serving_instances():
    d = small_deployment([{"name": "u", "role": "union", "count": 2, "spares": 1}])
    validate_deployment(d)
    assert [(s.instance_id, s.spare) for s in expand(d).values()] == [("u-0", False), ("u-1", False), ("u-2", True)]
    specs = GroupSpecs(d)
    assert specs.spec("u", 7).spare is False and specs.spec("u", 7, spare=True).spare is True
    assert specs.spec("u", 7).paired_instance_id == ""
