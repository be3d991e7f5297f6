"""Validation of a deployment file, field by field.

The controller is the one owner of deployment meaning; every error names the field to fix,
e.g. `instance_groups[1].pair_with: 'decoder' is not a group of this deployment`.
"""

from __future__ import annotations

import math
import re

from controller.rules import restart_policy
from controller.rules.adapter_names import adapter_problems
from controller.rules.engine_sections import engine_config_problems
from controller.rules.expansion import config_section, integral_numbers, struct_dict
from motor.contract import names
from motor.contract.engine_policy import check_engine_config
from motor.contract.pbtime import seconds
from motor.errors import InvalidArgument
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
        problems.extend(engine_config_problems(integral_numbers(engine_config), model=d.model.strip()))
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
# Requests in flight per engine the autoscaler aims at. Below a hundredth the arithmetic stops being
# meaningful (1.0e-310 overflowed it); above a million no engine holds that many.
TARGET_IN_FLIGHT_RANGE = (0.01, 1_000_000.0)


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
    low, high = TARGET_IN_FLIGHT_RANGE
    if not (a.target_in_flight > 0 and math.isfinite(a.target_in_flight)):
        problems.append(
            f"{where}.target_in_flight: required: a positive number of requests in flight per engine "
            f"(got {a.target_in_flight})"
        )
    elif not low <= a.target_in_flight <= high:
        problems.append(
            f"{where}.target_in_flight: must be from {low:g} to {high:.0f} requests in flight per engine "
            f"(got {a.target_in_flight:g})"
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
