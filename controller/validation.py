"""Validation of a deployment, field by field, and its expansion into instances.

The controller is the one owner of deployment meaning; every error names the field to fix,
e.g. `instance_groups[1].pair_with: 'decoder' is not a group of this deployment`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import struct_pb2

from controller import restart_policy
from controller.adapters import adapter_problems
from controller.engine_sections import engine_config_problems
from controller.slicing import Budget, Steps, run_at_once
from motor.contract import names
from motor.contract.engine_policy import check_engine_config
from motor.contract.pbtime import seconds
from motor.contract.user_config import section_name_for
from motor.errors import InvalidArgument, ResourceExhausted
from motor.v1 import controller_pb2, types_pb2

# Group names become instance-id prefixes ("<group>-<index>"); leave room for the index.
GROUP_NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,55}")
# Deployment names are keys of the store (etcd: part of a key) and of the API's requests.
DEPLOYMENT_NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
MAX_COUNT = 10_000
MAX_DATA_PARALLEL = 1024
MAX_ACCELERATORS = 64
# Engines (instances x data-parallel ranks) one deployment may ask for: a large fleet's worth.
MAX_ENGINES_PER_DEPLOYMENT = 100_000
# Engines one node may report: a node runs an engine per accelerator or so (plus old copies
# being stopped); thousands are a broken or hostile node manager, whose list would stall the loop.
MAX_ENGINES_PER_NODE = 1024


def check_engine_count(node_id: str, count: int, limit: int, where: str) -> None:
    """RESOURCE_EXHAUSTED naming the limit when a node reports more engines than one node may run."""
    if count > limit:
        raise ResourceExhausted(
            f"{where}: node {node_id} reports {count} engines; one node may report at most "
            f"max_engines_per_node={limit} (controller setting --max-engines-per-node)"
        )


# Text of a reported engine that reaches events, logs, addresses or command lines.
REPORTED_TEXT = ("node_id", "log_path")
REPORTED_SPEC_TEXT = ("instance_id", "host", "master_dp_ip", "config_path")


def check_reported_engines(
    engines: Sequence[types_pb2.Engine], unchanged: Collection[int] = (), where: str = "engines"
) -> None:
    """INVALID_ARGUMENT naming the field (`engines[3].engine_id ...`) of the first engine a node
    reports whose id is not '<instance_id>/rank<n>' or whose text holds a control character:
    checked before anything of the report is kept (nothing stored, fenced or logged).
    `unchanged`: the places of the engines reported exactly as in the node's last report,
    checked then: not checked twice (a full heartbeat repeats them all, every beat)."""
    for i, engine in enumerate(engines):
        if i in unchanged:
            continue
        if names.ENGINE_ID_PATTERN.fullmatch(engine.engine_id) and not names.CONTROL_CHARACTER.search(
            "".join(value for _, value in reported_text(engine))
        ):
            continue  # a new or changed engine, fine: one regex each
        check_reported_engine(engine, f"{where}[{i}]")


def check_reported_engine(engine: types_pb2.Engine, where: str) -> None:
    names.parse_engine_id(engine.engine_id, f"{where}.engine_id")
    for field, value in reported_text(engine):
        names.check_printable(value, f"{where}.{field}")


def reported_text(engine: types_pb2.Engine) -> Iterator[tuple[str, str]]:
    """(field, value) of each text of a reported engine that reaches events, logs, addresses or command lines."""
    for name in REPORTED_TEXT:
        yield name, getattr(engine, name)
    for name in REPORTED_SPEC_TEXT:
        yield f"spec.{name}", getattr(engine.spec, name)


def config_section(role: int, engine_config: dict) -> str:
    """The user_config section an engine of `role` reads, e.g. motor_engine_prefill_config
    (union engines fall back to the prefill section, as the engine server does)."""
    return section_name_for(names.role_name(role), engine_config.keys())


def validate_deployment(
    deployment: controller_pb2.Deployment, max_engines: int = MAX_ENGINES_PER_DEPLOYMENT
) -> controller_pb2.Deployment:
    """Return a copy with defaults filled in, or raise InvalidArgument naming every bad field."""
    d = controller_pb2.Deployment()
    d.CopyFrom(deployment)
    problems: list[str] = []
    if not d.name.strip():
        problems.append("name: required (a name for this deployment, e.g. 'local-sim')")
    elif not DEPLOYMENT_NAME_PATTERN.fullmatch(d.name):
        problems.append(
            f"name: {names.excerpt(d.name)} must be 1-63 lowercase letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (e.g. 'chat-large')"
        )
    if not d.model.strip():
        problems.append("model: required (the model name or path the engines serve)")
    if not d.instance_groups:
        problems.append("instance_groups: at least one group is required")
    engine_config = struct_dict(d.engine_config)  # {} when unset
    try:  # programs and code never come from a deployment (each node manager also checks paths)
        check_engine_config(engine_config, None, "engine_config")
    except InvalidArgument as exc:
        problems.append(str(exc))
    else:  # then as its engine servers will read it
        problems.extend(engine_config_problems(integral_numbers(engine_config)))
    seen: dict[str, int] = {}
    for i, group in enumerate(d.instance_groups):
        where = f"instance_groups[{i}]"
        if not GROUP_NAME_PATTERN.fullmatch(group.name):
            problems.append(
                f"{where}.name: {names.excerpt(group.name)} must be 1-56 lowercase letters, digits, '.', '_' or '-', "
                "starting with a letter or digit (instances are named '<name>-<index>')"
            )
        elif group.name in seen:
            problems.append(f"{where}.name: {group.name!r} is already the name of instance_groups[{seen[group.name]}]")
        else:
            seen[group.name] = i
        if group.role not in names.ROLE_NAMES:
            problems.append(f"{where}.role: required: prefill, decode or union")
        count_given = group.count != 0
        if not count_given:
            group.count = 1
        if group.count > MAX_COUNT:
            problems.append(f"{where}.count: must be at most {MAX_COUNT} (got {group.count})")
        if group.spares > MAX_COUNT:
            problems.append(f"{where}.spares: must be at most {MAX_COUNT} (got {group.spares})")
        if group.HasField("autoscaling"):
            problems.extend(autoscaling_problems(group, where, count_given))
        if group.data_parallel_size == 0:
            group.data_parallel_size = 1
        if group.data_parallel_size > MAX_DATA_PARALLEL:
            problems.append(
                f"{where}.data_parallel_size: must be at most {MAX_DATA_PARALLEL} (got {group.data_parallel_size})"
            )
        if not group.HasField("accelerators_per_engine"):
            group.accelerators_per_engine = 1
        if group.accelerators_per_engine > MAX_ACCELERATORS:
            problems.append(
                f"{where}.accelerators_per_engine: must be at most {MAX_ACCELERATORS} (got "
                f"{group.accelerators_per_engine})"
            )
        if group.role in names.ROLE_NAMES:
            section = config_section(group.role, engine_config)
            if not isinstance(engine_config.get(section), dict):
                problems.append(
                    f"engine_config.{section}: required by {where} (role {names.role_name(group.role)}): "
                    "the user_config section its engines read"
                )
    # A decode group paired with an autoscaled prefill group scales with it (to the prefill's max).
    pair_max = {g.pair_with: most_instances(g) for g in d.instance_groups if g.pair_with}
    engines = sum(
        (max(most_instances(g), pair_max.get(g.name, 0)) + g.spares) * g.data_parallel_size for g in d.instance_groups
    )
    if engines > max_engines:
        autoscaled = " or autoscaling max" if any(g.HasField("autoscaling") for g in d.instance_groups) else ""
        problems.append(
            f"instance_groups: {engines} engines (count{autoscaled} x data_parallel_size"
            f"{', spares included' if any(g.spares for g in d.instance_groups) else ''}) exceed the limit "
            f"max_engines_per_deployment={max_engines} (controller setting --max-engines-per-deployment)"
        )
    by_name = {g.name: g for g in d.instance_groups}
    for i, group in enumerate(d.instance_groups):
        if not group.pair_with:
            continue
        partner = by_name.get(group.pair_with)
        if partner is not None and partner.HasField("autoscaling"):
            j = next(k for k, g in enumerate(d.instance_groups) if g.name == group.pair_with)
            problems.append(
                f"instance_groups[{j}].autoscaling: decode group {partner.name!r} is paired with prefill group "
                f"{group.name!r} (instance i with instance i, equal counts): the pair scales as one, so put the "
                "autoscaling block on the prefill group only (or leave out pair_with: unpaired prefill and decode "
                "groups each scale on their own load)"
            )
        where = f"instance_groups[{i}].pair_with"
        target = by_name.get(group.pair_with)
        if group.role != types_pb2.ROLE_PREFILL:
            problems.append(
                f"{where}: only a prefill group pairs with a decode group (this group's role is "
                f"{names.role_name(group.role)})"
            )
        elif target is None:
            problems.append(
                f"{where}: {names.excerpt(group.pair_with)} is not a group of this deployment (groups: "
                f"{', '.join(sorted(by_name))})"
            )
        elif target.role != types_pb2.ROLE_DECODE:
            problems.append(
                f"{where}: {group.pair_with!r} is a {names.role_name(target.role)} group, not a decode group"
            )
        elif target.count != group.count:
            problems.append(
                f"{where}: {group.pair_with!r} has {target.count} instance(s) and this group {group.count}: "
                "paired groups pair instance i with instance i, so their counts must match"
            )
        elif target.spares != group.spares:
            problems.append(
                f"instance_groups[{i}].spares: {group.pair_with!r} has {target.spares} spare(s) and this group "
                f"{group.spares}: a P/D pair is promoted whole, so paired groups need the same number of spares"
            )
    p = d.restart_policy
    for name in restart_policy.DURATION_FIELDS:
        if p.HasField(name) and seconds(getattr(p, name)) <= 0:
            problems.append(
                f"restart_policy.{name}: must be a positive duration such as '1s' (got {seconds(getattr(p, name))}s)"
            )
    if (
        p.HasField("max_backoff")
        and p.HasField("initial_backoff")
        and seconds(p.max_backoff) < seconds(p.initial_backoff)
    ):
        problems.append(
            f"restart_policy.max_backoff: must be at least initial_backoff ({seconds(p.initial_backoff)}s), got "
            f"{seconds(p.max_backoff)}s"
        )
    restart_policy.fill_defaults(p)
    problems.extend(strategy_problems(d.strategy))
    problems.extend(adapter_problems(d))
    if problems:
        raise InvalidArgument("invalid deployment: " + "; ".join(problems))
    return d


ROLLOUT_DEFAULTS = {"progress_deadline": 600.0, "min_ready": 5.0}


DEFAULT_SCALE_DOWN_DELAY_S = 300.0


def most_instances(group: controller_pb2.InstanceGroup) -> int:
    """The most serving instances the group may have: its autoscaling max, else its count."""
    return max(group.count, group.autoscaling.max) if group.HasField("autoscaling") else group.count


def autoscaling_problems(group: controller_pb2.InstanceGroup, where: str, count_given: bool) -> list[str]:
    """Check a group's autoscaling block and fill its defaults (min 0 -> 1, delay 0 -> 300 s)."""
    a, problems = group.autoscaling, []
    where = f"{where}.autoscaling"
    if a.min == 0:
        a.min = 1  # no scale to zero: the router cannot hold requests while an engine loads
    if a.scale_down_delay_s == 0:
        a.scale_down_delay_s = DEFAULT_SCALE_DOWN_DELAY_S
    if a.max < a.min or a.max > MAX_COUNT:
        problems.append(f"{where}.max: required, at least min ({a.min}) and at most {MAX_COUNT} (got {a.max})")
    elif not a.min <= group.count <= a.max:
        count = f"{group.count} is" if count_given else f"not given ({group.count} by default), which is"
        advice = " (count is the starting count)" if count_given else ": give the starting count"
        problems.append(
            f"{where[: -len('.autoscaling')]}.count: {count} outside autoscaling min {a.min} .. max {a.max}{advice}"
        )
    if not (a.target_in_flight > 0 and math.isfinite(a.target_in_flight)):
        problems.append(
            f"{where}.target_in_flight: required: a positive number of requests in flight per engine "
            f"(got {a.target_in_flight})"
        )
    if a.scale_down_delay_s < 0 or not math.isfinite(a.scale_down_delay_s):
        problems.append(f"{where}.scale_down_delay_s: must not be negative (got {a.scale_down_delay_s})")
    return problems


def strategy_problems(strategy: controller_pb2.UpdateStrategy) -> list[str]:
    """What is wrong with `strategy` (its unset fields set to their defaults, in place)."""
    problems = []
    if strategy.type == controller_pb2.UPDATE_STRATEGY_TYPE_UNSPECIFIED:
        strategy.type = controller_pb2.UPDATE_STRATEGY_TYPE_ROLLING
    if not strategy.HasField("max_surge"):
        strategy.max_surge = 1
    if not strategy.HasField("max_unavailable"):
        strategy.max_unavailable = 0
    for name, default in ROLLOUT_DEFAULTS.items():
        if not strategy.HasField(name):
            getattr(strategy, name).FromSeconds(int(default))
        elif seconds(getattr(strategy, name)) < 0 or (
            name == "progress_deadline" and not seconds(strategy.progress_deadline)
        ):
            problems.append(f"strategy.{name}: must be a positive duration such as '30s'")
    if strategy.type == controller_pb2.UPDATE_STRATEGY_TYPE_ROLLING and not (
        strategy.max_surge or strategy.max_unavailable
    ):
        problems.append(
            "strategy.max_surge: max_surge and max_unavailable are both 0, so a rollout could neither start a new "
            "instance nor stop an old one: set max_surge (extra instances) or max_unavailable (in place)"
        )
    return problems


@dataclass(frozen=True)
class InstanceSpec:
    """One instance the deployment asks for."""

    instance_id: str
    group: str
    role: int
    index: int
    data_parallel_size: int
    accelerators_per_engine: int
    single_container: bool
    paired_instance_id: str
    # Changes when anything its engines are launched with changes (restart needed).
    spec_hash: str
    # Starts as a warm spare (index >= count); afterwards promotions move the flag (controller/spares.py).
    spare: bool = False


def struct_dict(struct: struct_pb2.Struct) -> dict:
    """A Struct as plain Python values: how the controller reads engine_config, for validation,
    expansion and config_json alike. Unlike json_format.MessageToDict, which raises ValueError on
    NaN and infinities (an UNKNOWN error), it keeps them for check_engine_config to name the key."""
    return {key: _plain_value(value) for key, value in struct.fields.items()}


def _plain_value(value: struct_pb2.Value) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "struct_value":
        return struct_dict(value.struct_value)
    if kind == "list_value":
        return [_plain_value(item) for item in value.list_value.values]
    return None if kind in (None, "null_value") else getattr(value, kind)


def expand(deployment: controller_pb2.Deployment) -> dict[str, InstanceSpec]:
    """Instances "<group>-<i>" of a validated deployment."""
    return run_at_once(expand_in_slices(deployment, None))


def expand_in_slices(deployment: controller_pb2.Deployment, budget: Budget | None) -> Steps[dict[str, InstanceSpec]]:
    """`expand`, yielding when `budget` is spent (10,000 instances: 25-40 ms at once)."""
    specs = GroupSpecs(deployment)
    out: dict[str, InstanceSpec] = {}
    for group in deployment.instance_groups:
        for index in range(group.count + group.spares):
            spec = specs.spec(group.name, index, spare=index >= group.count)
            out[spec.instance_id] = spec
            if budget is not None:
                yield from budget.checkpoint()
    return out


class GroupSpecs:
    """The spec of any instance "<group>-<index>" of a validated deployment: a rolling update
    starts new instances at indices beyond `count` while the old ones serve."""

    def __init__(self, deployment: controller_pb2.Deployment):
        engine_config = struct_dict(deployment.engine_config)
        self.groups = {g.name: g for g in deployment.instance_groups}
        self.hashes: dict[str, str] = {}
        # Paired groups: instance i of a prefill group with instance i of its decode group (both ways).
        self.partners: dict[str, str] = {}
        for group in deployment.instance_groups:
            section = engine_config.get(config_section(group.role, engine_config))
            self.hashes[group.name] = hashlib.sha256(
                json.dumps(
                    [
                        deployment.model,
                        group.role,
                        group.data_parallel_size,
                        group.accelerators_per_engine,
                        group.single_container,
                        section,
                    ],
                    sort_keys=True,
                ).encode()
            ).hexdigest()[:16]
            if group.pair_with:
                self.partners[group.name] = group.pair_with
                self.partners.setdefault(group.pair_with, group.name)

    def spec(self, group_name: str, index: int, spare: bool = False) -> InstanceSpec:
        group, partner = self.groups[group_name], self.partners.get(group_name)
        return InstanceSpec(
            instance_id=f"{group.name}-{index}",
            group=group.name,
            role=group.role,
            index=index,
            data_parallel_size=group.data_parallel_size,
            accelerators_per_engine=group.accelerators_per_engine,
            single_container=group.single_container,
            paired_instance_id=f"{partner}-{index}" if partner else "",
            spec_hash=self.hashes[group.name],
            spare=spare,
        )


def integral_numbers(value: Any) -> Any:
    """google.protobuf.Struct stores every number as a double: give engines back their ints
    (engine servers validate `max_failure_count: 3`, not 3.0)."""
    if isinstance(value, dict):
        return {k: integral_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [integral_numbers(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
