"""Pure pieces of the controller: placement, the instance state machine, the restart policy,
deployment validation, the store, the configuration."""

from __future__ import annotations

import subprocess
import sys

import pytest
from google.protobuf import json_format
from google.protobuf.struct_pb2 import Struct

from controller.model.instances import (
    DEGRADED,
    FAILED,
    READY,
    RESTARTING,
    STARTING,
    IllegalTransition,
    InstanceRecord,
    Policy,
    on_failure,
    transition,
)
from controller.rules.deployment_checks import validate_deployment
from controller.rules.expansion import expand, struct_dict
from controller.rules.placement import NodeCapacity, Unplaceable, place_instance
from controller.store.interface import StoredNode
from controller.store.sqlite import SqliteStore
from motor.errors import InvalidArgument
from motor.v1 import controller_pb2 as C
from tests.support.controller_harness import example_deployment, small_deployment

# ---------------------------------------------------------------- placement


def test_best_fit_packs_and_keeps_big_holes():
    nodes = [NodeCapacity("a", "h-a", [0, 1, 2, 3]), NodeCapacity("b", "h-b", [0, 1], used_accelerators={0})]
    placed = place_instance([0], 1, False, nodes)
    assert placed[0].node_id == "b" and placed[0].accelerator_ids == (1,)  # the fuller node
    placed = place_instance([0, 1], 2, False, nodes)
    assert [(p.node_id, p.accelerator_ids) for p in placed] == [("a", (0, 1)), ("a", (2, 3))]
    assert nodes[0].free_accelerators == [] and nodes[1].free_accelerators == []


def test_unplaceable_says_why_and_changes_nothing():
    nodes = [NodeCapacity("a", "h", [0, 1]), NodeCapacity("b", "h", [0])]
    with pytest.raises(Unplaceable) as err:
        place_instance([0, 1], 2, False, nodes)
    assert "rank 1 needs 2 accelerator(s)" in str(err.value) and "2 READY node(s); most free: a with 2/2" in str(
        err.value
    )
    assert nodes[0].free_accelerators == [0, 1]  # the partial placement of rank 0 was not kept
    with pytest.raises(Unplaceable, match="no READY node"):
        place_instance([0], 1, False, [])


def test_ports_of_a_range_are_counted():
    nodes = [NodeCapacity("a", "h", [], port_range=(100, 104))]  # 5 ports
    assert [p.port_count for p in place_instance([0, 1], 0, False, nodes)] == [2, 2]
    with pytest.raises(Unplaceable, match="4 port"):
        place_instance([0], 0, True, nodes)  # single-container engines take 4
    assert place_instance([0], 0, False, [NodeCapacity("b", "h", [])])[0].port_count == 2  # no range: unlimited


# ---------------------------------------------------------------- state machine and policy


def record(**kw) -> InstanceRecord:
    return InstanceRecord("p-0", "p", 1, 2, 1, False, "", "x", **kw)


def test_transitions_need_a_reason_and_follow_the_table():
    r = record()
    with pytest.raises(ValueError):
        transition(r, STARTING, "", 0)
    assert transition(r, STARTING, "placed", 1.0)
    assert not transition(r, STARTING, "placed", 2.0)  # nothing changed
    assert transition(r, READY, "all NORMAL", 3.0) and r.healthy_since == 3.0
    transition(r, DEGRADED, "rank 1 ABNORMAL", 4.0)
    assert r.healthy_since == 3.0  # a degraded spell keeps the healthy clock
    transition(r, RESTARTING, "rank 1 failed", 5.0)
    assert r.healthy_since is None and r.state_changed_at == 5.0
    transition(r, FAILED, "budget spent", 6.0)
    with pytest.raises(IllegalTransition):
        transition(r, READY, "cannot jump from FAILED to READY", 7.0)


def test_backoff_immediate_then_doubling_capped_and_budget():
    policy = Policy(initial_backoff=1, max_backoff=4, max_failures=6, failure_window=1000, reset_after=600)
    r = record()
    delays = [on_failure(r, policy, float(t)).delay for t in range(5)]
    assert delays == [0, 1, 2, 4, 4]
    decision = on_failure(r, policy, 5.0)
    assert decision.give_up and decision.failures_in_window == 6


def test_backoff_resets_after_healthy_time_and_window_forgets():
    policy = Policy(initial_backoff=1, max_backoff=60, max_failures=3, failure_window=100, reset_after=50)
    r = record()
    on_failure(r, policy, 0.0)
    assert on_failure(r, policy, 1.0).delay == 1
    r.healthy_since = 10.0
    assert on_failure(r, policy, 70.0).delay == 0  # healthy for 60 s >= reset_after: immediate again
    # Failures older than the window do not count against the budget.
    assert not on_failure(r, policy, 200.0).give_up


def test_policy_from_proto_defaults():
    p = Policy.from_proto(validate_deployment(small_deployment([{"name": "u", "role": "union"}])).restart_policy)
    assert (p.group_scope, p.initial_backoff, p.max_backoff, p.reset_after, p.max_failures, p.failure_window) == (
        True,
        1,
        60,
        600,
        5,
        600,
    )


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "groups, extra, field",
    [
        ([], {}, "instance_groups: at least one group"),
        ([{"name": "u"}], {}, "instance_groups[0].role: required"),
        (
            [{"name": "u", "role": "union"}, {"name": "u", "role": "union"}],
            {},
            "instance_groups[1].name: 'u' is already",
        ),
        ([{"name": "-bad", "role": "union"}], {}, "instance_groups[0].name"),
        (
            [{"name": "p", "role": "prefill", "pair_with": "u"}, {"name": "u", "role": "union"}],
            {},
            "'u' is a union group, not a decode group",
        ),
        (
            [{"name": "p", "role": "prefill", "pair_with": "d", "count": 2}, {"name": "d", "role": "decode"}],
            {},
            "counts must match",
        ),
        ([{"name": "d", "role": "decode", "pair_with": "d"}], {}, "only a prefill group pairs"),
        ([{"name": "u", "role": "union", "count": 100000}], {}, "instance_groups[0].count: must be at most"),
        (
            [{"name": "u", "role": "union"}],
            {"restart_policy": {"initial_backoff": "5s", "max_backoff": "1s"}},
            "restart_policy.max_backoff",
        ),
        (
            [{"name": "u", "role": "union"}],
            {"restart_policy": {"failure_window": "-1s"}},
            "restart_policy.failure_window",
        ),
        ([{"name": "u", "role": "union"}], {"model": ""}, "model: required"),
    ],
)
def test_invalid_deployments_name_the_field(groups, extra, field):
    with pytest.raises(InvalidArgument) as err:
        validate_deployment(small_deployment(groups, **extra))
    assert field in str(err.value)


def test_missing_engine_config_section_is_named():
    deployment = example_deployment()
    del deployment.engine_config.fields["motor_engine_decode_config"]
    with pytest.raises(
        InvalidArgument, match=r"engine_config.motor_engine_decode_config: required by instance_groups\[1\]"
    ):
        validate_deployment(deployment)


def test_engine_config_numbers_that_are_not_finite_are_named_not_an_internal_error():
    """json_format.MessageToDict raises ValueError on NaN in a Struct; the check names the key."""
    deployment = example_deployment()
    section = deployment.engine_config.fields["motor_engine_decode_config"].struct_value
    section.fields["engine_args"].struct_value.fields["ratio"].list_value.values.add().number_value = float("inf")
    with pytest.raises(
        InvalidArgument, match=r"engine_config.motor_engine_decode_config.engine_args.ratio\[0\]: inf is not a finite"
    ):
        validate_deployment(deployment)
    config = Struct()
    config.update({"s": {"n": 1, "t": "x", "b": False, "z": None, "l": [2.5, {"y": True}]}})
    config.fields["unset"].SetInParent()  # a Value with no kind: None, as MessageToDict has it
    assert (
        struct_dict(config)
        == json_format.MessageToDict(config)
        == {"s": {"n": 1.0, "t": "x", "b": False, "z": None, "l": [2.5, {"y": True}]}, "unset": None}
    )


@pytest.mark.parametrize("key, value, says", [
    ("distributed_executor_backend", "ray", "Ray is not supported"),
    ("ssl_certfile", "/certs/engine.pem", "TLS on the inference plane is not supported"),
])  # fmt: skip
def test_vllm_settings_that_cannot_work_are_refused_at_apply_naming_the_key(key, value, says):
    deployment = example_deployment()
    section = deployment.engine_config.fields["motor_engine_decode_config"].struct_value
    section.fields["engine_type"].string_value = "vllm"
    section.fields["engine_args"].struct_value.Clear()
    section.fields["engine_args"].struct_value.update({"model": "Qwen/Qwen2-0.5B", key: value})
    with pytest.raises(InvalidArgument, match=rf"engine_config.motor_engine_decode_config.engine_args.{key}: .*{says}"):
        validate_deployment(deployment)


def test_union_group_falls_back_to_the_prefill_section_like_the_engine_server():
    deployment = small_deployment([{"name": "u", "role": "union"}])
    del deployment.engine_config.fields["motor_engine_union_config"]
    validate_deployment(deployment)  # accepted: union engines read motor_engine_prefill_config
    del deployment.engine_config.fields["motor_engine_prefill_config"]
    with pytest.raises(
        InvalidArgument, match=r"engine_config.motor_engine_union_config: required by instance_groups\[0\]"
    ):
        validate_deployment(deployment)


def test_defaults_and_expansion():
    d = validate_deployment(
        small_deployment(
            [
                {"name": "p", "role": "prefill", "count": 2, "pair_with": "d", "data_parallel_size": 2},
                {"name": "d", "role": "decode", "count": 2},
            ]
        )
    )
    assert d.instance_groups[1].accelerators_per_engine == 1 and d.restart_policy.scope == C.RESTART_SCOPE_GROUP
    instances = expand(d)
    assert sorted(instances) == ["d-0", "d-1", "p-0", "p-1"]
    assert instances["p-1"].paired_instance_id == "d-1" and instances["d-1"].paired_instance_id == "p-1"
    assert instances["p-0"].data_parallel_size == 2
    zero = validate_deployment(small_deployment([{"name": "u", "role": "union", "accelerators_per_engine": 0}]))
    assert zero.instance_groups[0].accelerators_per_engine == 0  # explicit 0 stays 0 (CPU engines)


# ---------------------------------------------------------------- store and configuration


def test_store_round_trip_survives_reopen(tmp_path):
    path = str(tmp_path / "s.db")
    store = SqliteStore(path)
    assert store.next_generation() == 1 and store.next_generation() == 2
    with store.transaction():
        store.save_deployment(b"dep", 3)
        store.save_node(StoredNode("n", b"info", 2, C.NODE_STATE_LOST, "gone"))
        store.save_assignment("u-0/rank0", {"node_id": "n", "generation": 2})
        store.save_instance("u-0", {"state": 6, "restarts": 4})
    with pytest.raises(RuntimeError):
        with store.transaction():
            store.save_instance("u-1", {"state": 1})
            raise RuntimeError("rolled back")
    store.close()
    again = SqliteStore(path)
    state = again.load()
    assert (state.deployment, state.revision, state.generation) == (b"dep", 3, 2)
    assert state.nodes == [StoredNode("n", b"info", 2, C.NODE_STATE_LOST, "gone")]
    assert state.assignments == {"u-0/rank0": {"node_id": "n", "generation": 2}}
    assert state.instances == {"u-0": {"state": 6, "restarts": 4}}
    assert again.next_generation() == 3
    again.close()


def test_the_generation_counter_goes_above_what_nodes_report_and_forgets_a_rolled_back_raise(tmp_path):
    store = SqliteStore(str(tmp_path / "g.db"))
    assert store.last_generation() == 0 and store.next_generation(above=41) == 42 and store.last_generation() == 42
    assert store.next_generation(above=7) == 43  # never lower than what it issued
    with pytest.raises(RuntimeError):
        with store.transaction():
            assert store.next_generation(above=1000) == 1001
            raise RuntimeError("rolled back")
    assert store.last_generation() == 43 and store.next_generation() == 44
    store.close()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--node-grace", "0"], "node_grace: Input should be greater than 0"),
        # 1e-9 was taken: the node monitor then slept interval/2 in a loop (97% of a core, no node).
        (
            ["--heartbeat-interval", "1e-9", "--node-grace", "1"],
            "heartbeat_interval: Input should be greater than or equal to 0.05",
        ),
        # A grace within one interval would suspect every node between two of its beats.
        (["--heartbeat-interval", "4", "--node-grace", "2"], "node_grace: must be more than heartbeat_interval (4s)"),
        (["--heartbeat-interval", "2", "--node-grace", "2"], "node_grace: must be more than heartbeat_interval (2s)"),
        # 1e-14 made the announced interval overflow: every RegisterNode failed (OverflowError, UNKNOWN).
        (["--max-heartbeats-per-second", "1e-14"], "max_heartbeats_per_second: must be 0 (off) or at least 1"),
        (["--max-heartbeats-per-second", "0.5"], "max_heartbeats_per_second: must be 0 (off) or at least 1"),
        # Infinite: after a restart nothing would ever start, on a new store --deployment never applied.
        (["--startup-grace", "inf"], "startup_grace: Input should be a finite number"),
        # nan fails every bound: the message says what is wrong with it, not a bound.
        (["--heartbeat-interval", "nan"], "heartbeat_interval: Input should be a finite number (got 'nan')"),
        (["--silent-share-alarm", "2"], "silent_share_alarm"),
        (["--listen", "nowhere"], "listen: must be host:port"),
        (["--metrics-port", "x"], "metrics_port"),
    ],
)
@pytest.mark.processes
def test_bad_settings_exit_2_naming_the_field(args, message, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "controller.cli", "--db", str(tmp_path / "c.db"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and message in result.stderr


def test_config_file_and_unknown_keys(tmp_path):
    from controller.cli import parse_config
    from motor.errors import ConfigError

    config = tmp_path / "controller.yaml"
    config.write_text("node_grace: 7\nreschedule_rate: 3\n")
    parsed = parse_config(["--config", str(config), "--reschedule-rate", "4"])
    assert parsed.node_grace == 7 and parsed.reschedule_rate == 4  # flags win
    config.write_text("node_grase: 7\n")
    with pytest.raises(ConfigError, match="node_grase: Extra inputs are not permitted"):
        parse_config(["--config", str(config)])


def test_reschedule_rate_limit_refills_over_time():
    from controller.capacity.scheduling import TokenBucket

    now = [0.0]
    bucket = TokenBucket(2, lambda: now[0])
    assert bucket.available(2)
    bucket.take(2)
    assert not bucket.available(1)  # spent: a node loss now waits
    now[0] = 0.5
    assert bucket.available(1) and not bucket.available(2)
    now[0] = 10.0
    assert bucket.available(5)  # a move bigger than the burst goes once the bucket is full
