"""What a host offers its engines: its GPUs, else its CPU cores (`--accelerator-type auto`).

The one home of the rule, used by the node manager (`--accelerator-type auto`) and by
`motorctl up` (which shares one host's devices among its node managers):
- GPUs: the indices `CUDA_VISIBLE_DEVICES` lists when it is set (empty: none), else as many as
  NVML counts (pynvml / nvidia-ml-py, present on GPU machines with vLLM). Their type is `nvidia`:
  each engine gets `CUDA_VISIBLE_DEVICES` set to its own.
- Otherwise the CPU cores this process may run on. Their type is `cpu`: each engine (vLLM CPU)
  is bound to its own cores (node_manager/specs.py), so engines of one host do not stall each other.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from motor.errors import ConfigError

GPU_TYPE = "nvidia"
CPU_TYPE = "cpu"


@dataclass(frozen=True)
class HostAccelerators:
    type: str  # GPU_TYPE or CPU_TYPE
    ids: tuple[int, ...]
    source: str  # where they were found, for messages: "CUDA_VISIBLE_DEVICES", "NVML", "CPU affinity"


def nvml_gpu_count() -> int:
    """GPUs NVML sees; 0 without pynvml, a driver or a GPU."""
    try:
        import pynvml  # not a dependency: present on GPU machines with vLLM
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 (no driver, no GPU: pynvml raises its own NVMLError kinds)
        return 0


def host_gpus(
    environ: Mapping[str, str] | None = None, count_gpus: Callable[[], int] = nvml_gpu_count
) -> tuple[int, ...]:
    """The GPU indices engines may be given: CUDA_VISIBLE_DEVICES when set, else NVML's count."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return tuple(range(count_gpus()))
    items = [item.strip() for item in visible.split(",") if item.strip()]
    if not all(item.isdigit() for item in items):
        raise ConfigError(
            f"CUDA_VISIBLE_DEVICES={visible!r}: only GPU indices (e.g. 0,1) can be handed to engines; "
            "give the indices, or the accelerators explicitly (--accelerators 0,1)"
        )
    return tuple(int(item) for item in items if int(item) >= 0)


def host_cpus() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))


def detect(
    kind: str = "auto", environ: Mapping[str, str] | None = None, count_gpus: Callable[[], int] = nvml_gpu_count
) -> HostAccelerators:
    """The host's accelerators of `kind`: "gpu", "cpu", or "auto" (GPUs when there are any, else CPU cores)."""
    if kind in ("gpu", "auto"):
        environ = os.environ if environ is None else environ
        gpus = host_gpus(environ, count_gpus)
        if gpus:
            source = "CUDA_VISIBLE_DEVICES" if "CUDA_VISIBLE_DEVICES" in environ else "NVML"
            return HostAccelerators(GPU_TYPE, gpus, source)
        if kind == "gpu":
            raise ConfigError(
                "accelerator_type gpu: no GPU found (NVML sees none, or CUDA_VISIBLE_DEVICES lists none); "
                "on a machine without GPUs use cpu (vLLM's CPU build) or sim (the simulated engine)"
            )
    elif kind != "cpu":
        raise ConfigError(f"accelerator kind {kind!r}: must be gpu, cpu or auto")
    return HostAccelerators(CPU_TYPE, host_cpus(), "CPU affinity")
