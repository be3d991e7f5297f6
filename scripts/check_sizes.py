"""The code's sizes, held where a newcomer can still read it (`make lint`; docs/design.md#layers):
the controller's top level at most 8 modules, none of its rooms over 9 modules or 1,500 lines, no
product module over 450 lines (the generated API in motor/v1 aside)."""

from __future__ import annotations

import sys
from pathlib import Path

PACKAGES = ("motor", "controller", "node_manager", "engine_server", "router_sync", "front_door", "motorctl")
MAX_TOP_LEVEL = {"controller": 8}
MAX_MODULES, MAX_PACKAGE_LINES, MAX_MODULE_LINES = 9, 1500, 450
GENERATED = Path("motor/v1")
ROOMS = Path("controller")  # the package kept in rooms


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def problems() -> list[str]:
    found = []
    for root in map(Path, PACKAGES):
        for package in [root, *sorted(p for p in root.rglob("*") if p.is_dir() and (p / "__init__.py").exists())]:
            if package == GENERATED or GENERATED in package.parents:
                continue
            modules = sorted(package.glob("*.py"))
            limit = MAX_TOP_LEVEL.get(str(package), MAX_MODULES)
            if ROOMS in (package, *package.parents):
                if len(modules) > limit:
                    found.append(f"{package}/: {len(modules)} modules, at most {limit}: give a concern a room")
                total = sum(map(lines, modules))
                if total > MAX_PACKAGE_LINES and package != root:
                    found.append(f"{package}/: {total} lines, at most {MAX_PACKAGE_LINES}: split it by concern")
            for module in modules:
                if (n := lines(module)) > MAX_MODULE_LINES:
                    found.append(f"{module}: {n} lines, at most {MAX_MODULE_LINES}: split it by job")
    return found


if __name__ == "__main__":
    found = problems()
    for line in found:
        print(line)
    sys.exit(1 if found else 0)
