"""A validated deployment expanded into its instances ("<group>-<index>"), and the plain values
engines read from its engine_config."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from google.protobuf import struct_pb2

from controller.rules.slicing import Budget, Steps, run_at_once
from motor.contract import names
from motor.contract.user_config import section_name_for
from motor.v1 import controller_pb2


def config_section(role: int, engine_config: dict) -> str:
    """The user_config section an engine of `role` reads, e.g. motor_engine_prefill_config
    (union engines fall back to the prefill section, as the engine server does)."""
    return section_name_for(names.role_name(role), engine_config.keys())


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
    # Starts as a warm spare (index >= count); afterwards promotions move the flag (controller/capacity/spares.py).
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
