"""A deployment's LoRA adapters checked at apply: names of their own, paths inside the node's model
root (controller/routing/adapters.py loads them)."""

from __future__ import annotations

import posixpath
import re

from motor.contract import names
from motor.v1 import controller_pb2

C = controller_pb2

MAX_ADAPTERS = 64
ADAPTER_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def adapter_problems(deployment: C.Deployment) -> list[str]:
    """What is wrong with the deployment's adapters, each naming its field."""
    adapters = deployment.adapters
    if len(adapters) > MAX_ADAPTERS:
        return [f"adapters: at most {MAX_ADAPTERS} adapters per deployment (got {len(adapters)})"]
    problems, seen = [], {}
    for i, adapter in enumerate(adapters):
        where = f"adapters[{i}]"
        if not ADAPTER_NAME_PATTERN.fullmatch(adapter.name):
            problems.append(
                f"{where}.name: {names.excerpt(adapter.name)} must be 1-128 letters, digits, '.', '_', ':' or '-', "
                "starting with a letter or digit"
            )
        elif adapter.name == deployment.model:
            problems.append(
                f"{where}.name: {adapter.name!r} is the deployment's model; an adapter needs a name of its own"
            )
        elif adapter.name in seen:
            problems.append(f"{where}.name: {adapter.name!r} is already the name of adapters[{seen[adapter.name]}]")
        else:
            seen[adapter.name] = i
        path = adapter.path
        if (
            not path
            or names.CONTROL_CHARACTER.search(path)
            or path.startswith("/")
            or posixpath.isabs(path)
            or ".." in path.split("/")
            or posixpath.normpath(path) != path.rstrip("/")
        ):
            problems.append(
                f"{where}.path: {names.excerpt(path)} must be a folder inside the node's model root, given "
                "relative to it without '..' (e.g. 'adapters/sql-lora')"
            )
    return problems
