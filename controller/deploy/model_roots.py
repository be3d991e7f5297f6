"""A deployment's local paths against the model roots its nodes announce (RegisterNode's
NodeInfo.model_roots, each node manager's --model-roots).

A node manager refuses to start an engine whose configuration names a local path outside its
model roots (motor/contract/engine_policy.py). ApplyDeployment refuses a deployment that names a
path no registered node allows, naming the flag to add, instead of accepting it and having every
start refused. With no node registered yet nothing can be told: the deployment is accepted and its
instances wait for nodes, as any deployment's do; a node that then refuses the path fails the
instance at once with the node's words (controller/engines/lifecycle.py), without spending restarts.
"""

from __future__ import annotations

from collections.abc import Iterable

from controller.model.nodes import NodeRuntime
from controller.rules.expansion import struct_dict
from motor.contract.engine_policy import local_paths_outside
from motor.errors import InvalidArgument
from motor.v1 import controller_pb2

SHOWN = 3  # node groups, and node ids per group, named in a refusal (a fleet has thousands)


def check_local_paths(deployment: controller_pb2.Deployment, nodes: Iterable[NodeRuntime]) -> None:
    """InvalidArgument naming the first local path no node allows (and --model-root), when
    nodes are registered and none of them allows every local path `deployment` names."""
    engine_config = struct_dict(deployment.engine_config)
    if not local_paths_outside(engine_config, []):
        return  # no local path at all (model names, the simulated engine)
    by_roots: dict[tuple[str, ...], list[str]] = {}
    for node in nodes:
        by_roots.setdefault(tuple(node.info.model_roots), []).append(node.node_id)
    if not by_roots:
        return  # no node registered yet: accepted (see above)
    refused: list[tuple[tuple[str, ...], list[str], tuple[str, str]]] = []
    for roots, node_ids in by_roots.items():
        outside = local_paths_outside(engine_config, list(roots))
        if not outside:
            return  # this node (and its like) can start it
        refused.append((roots, sorted(node_ids), outside[0]))
    refused.sort(key=lambda item: (-len(item[1]), item[1][0]))
    key, local = refused[0][2]
    nodes_said = "; ".join(_nodes_allowing(roots, node_ids) for roots, node_ids, _ in refused[:SHOWN])
    if len(refused) > SHOWN:
        nodes_said += f"; {sum(len(ids) for _, ids, _ in refused[SHOWN:])} more node(s)"
    raise InvalidArgument(
        f"{key}: {local!r} is a local path that no registered node allows ({nodes_said}): start the node "
        "managers with --model-root DIR, a folder holding it (motorctl up --model-root DIR; compose: "
        "MOTOR_MODEL_ROOTS), then apply again"
    )


def _nodes_allowing(roots: tuple[str, ...], node_ids: list[str]) -> str:
    named = ", ".join(node_ids[:SHOWN]) + (f" and {len(node_ids) - SHOWN} more" if len(node_ids) > SHOWN else "")
    allows = f"allow{'s' if len(node_ids) == 1 else ''}"
    return f"{named} {allows} {'only ' + ', '.join(roots) if roots else 'no local paths'}"
