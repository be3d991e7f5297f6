"""What a host offers its engines: its GPUs, else its CPU cores (`--accelerator-type auto`).

The one home of the rule, used by the node manager (`--accelerator-type auto`) and by
`motorctl up` (which shares one host's devices among its node managers):
- GPUs: the indices `CUDA_VISIBLE_DEVICES` lists when it is set (empty: none); else, in a
  container given GPUs by the NVIDIA container runtime (Kubernetes' device plugin sets
  `NVIDIA_VISIBLE_DEVICES` to the UUIDs of the GPUs it assigned to the pod), as many as it lists,
  numbered from 0 as the container sees them (`all`: NVML's count; `none`, `void` or empty: none);
  else as many as NVML counts (pynvml / nvidia-ml-py, present on GPU machines with vLLM). Their
  type is `nvidia`: each engine gets `CUDA_VISIBLE_DEVICES` set to its own.
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
    source: str  # where they were found: "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NVML", "CPU affinity"


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
    """The GPU indices engines may be given: CUDA_VISIBLE_DEVICES when set, else the devices
    NVIDIA_VISIBLE_DEVICES hands this container, else NVML's count."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        assigned = assigned_devices(environ)
        return tuple(range(count_gpus() if assigned is None else assigned))
    items = [item.strip() for item in visible.split(",") if item.strip()]
    if not all(item.isdigit() for item in items):
        raise ConfigError(
            f"CUDA_VISIBLE_DEVICES={visible!r}: only GPU indices (e.g. 0,1) can be handed to engines; "
            "give the indices, or the accelerators explicitly (--accelerators 0,1)"
        )
    return tuple(int(item) for item in items if int(item) >= 0)


def assigned_devices(environ: Mapping[str, str]) -> int | None:
    """How many GPUs the NVIDIA container runtime put in this container, from the
    NVIDIA_VISIBLE_DEVICES it was given (UUIDs or host indices, comma-separated: the container
    sees them as 0..n-1); None when it is unset or `all` (then NVML counts them)."""
    value = environ.get("NVIDIA_VISIBLE_DEVICES")
    if value is None or value.strip() == "all":
        return None
    if value.strip() in ("", "none", "void"):
        return 0
    return len([item for item in value.split(",") if item.strip()])


def gpu_source(environ: Mapping[str, str]) -> str:
    if "CUDA_VISIBLE_DEVICES" in environ:
        return "CUDA_VISIBLE_DEVICES"
    return "NVML" if assigned_devices(environ) is None else "NVIDIA_VISIBLE_DEVICES"


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
            return HostAccelerators(GPU_TYPE, gpus, gpu_source(environ))
        if kind == "gpu":
            raise ConfigError(
                "accelerator_type gpu: no GPU found (NVML sees none, or CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES "
                "lists none); "
                "on a machine without GPUs use cpu (vLLM's CPU build) or sim (the simulated engine)"
            )
    elif kind != "cpu":
        raise ConfigError(f"accelerator kind {kind!r}: must be gpu, cpu or auto")
    return HostAccelerators(CPU_TYPE, host_cpus(), "CPU affinity")
