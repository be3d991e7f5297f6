"""Accelerator utilization samplers: NVML (NVIDIA), npu-smi (Ascend), the engine's own figure.

`choose_sampler` picks, in order: the engine's sampler (the simulated engine reports its simulated
figure), NVML when pynvml is importable and sees a GPU, npu-smi when the binary is on PATH, else a
sampler that reports 0 % (the accelerator then always counts as idle, so every failed probe counts).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil

from engine_server.engines.base import EngineBackend, UtilizationSampler

logger = logging.getLogger(__name__)


def visible_device_ids(variable: str) -> list[int] | None:
    """Device indices from CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES; None means all."""
    value = os.environ.get(variable, "").strip()
    if not value:
        return None
    ids = []
    for part in value.split(","):
        part = part.strip()
        if not part.isdigit():
            return None  # UUIDs or MIG names: fall back to every device
        ids.append(int(part))
    return ids


class IdleSampler(UtilizationSampler):
    """No utilization source on this machine: always 0 %."""

    name = "none"

    async def sample(self) -> float:
        return 0.0


class NvmlSampler(UtilizationSampler):
    """GPU utilization through NVML (pynvml / nvidia-ml-py). Peak over this engine's GPUs."""

    name = "nvml"

    def __init__(self, pynvml_module, device_ids: list[int] | None = None):
        self._nvml = pynvml_module
        self._nvml.nvmlInit()
        count = self._nvml.nvmlDeviceGetCount()
        ids = device_ids if device_ids is not None else list(range(count))
        self._handles = [self._nvml.nvmlDeviceGetHandleByIndex(i) for i in ids if i < count]
        if not self._handles:
            raise RuntimeError(f"NVML sees {count} GPUs, none of them among {ids}")

    def _read(self) -> float:
        return float(max(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles))

    async def sample(self) -> float:
        return await asyncio.to_thread(self._read)


# One NPU takes two rows of `npu-smi info`'s table:
# | 0     910B1               | OK            | 95.7        36                0    / 0             |
# | 0                         | 0000:C1:00.0  | 0           0    / 0          3396 / 65536         |
# the second row's third cell starts with AICore(%).
_FIRST_ROW = re.compile(r"^\|\s*(\d+)\s+\S.*\|\s*\S+\s*\|.*\|\s*$")
_SECOND_ROW = re.compile(r"^\|\s*\d+\s*\|\s*[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d\s*\|\s*(\d+(?:\.\d+)?)\s")


def parse_npu_smi_info(text: str) -> dict[int, float]:
    """AICore utilization (percent) by NPU id from `npu-smi info` output."""
    result: dict[int, float] = {}
    npu_id: int | None = None
    for line in text.splitlines():
        second = _SECOND_ROW.match(line)
        if second and npu_id is not None:
            result[npu_id] = float(second.group(1))
            npu_id = None
            continue
        first = _FIRST_ROW.match(line)
        if first and not line.lstrip("| ").startswith("NPU"):
            npu_id = int(first.group(1))
    return result


class NpuSmiSampler(UtilizationSampler):
    """Ascend NPU AICore utilization from `npu-smi info`. Peak over this engine's NPUs."""

    name = "npu-smi"

    def __init__(self, binary: str = "npu-smi", device_ids: list[int] | None = None, timeout: float = 5.0):
        self.binary, self.device_ids, self.timeout = binary, device_ids, timeout

    async def sample(self) -> float:
        process = await asyncio.create_subprocess_exec(
            self.binary, "info", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
        )
        try:
            async with asyncio.timeout(self.timeout):
                out, _ = await process.communicate()
        except TimeoutError:
            process.kill()
            await process.wait()
            raise RuntimeError(f"{self.binary} info did not answer within {self.timeout}s") from None
        usage = parse_npu_smi_info(out.decode(errors="replace"))
        if self.device_ids is not None:
            usage = {k: v for k, v in usage.items() if k in self.device_ids}
        if not usage:
            raise RuntimeError(f"{self.binary} info listed no NPU utilization for devices {self.device_ids or 'any'}")
        return max(usage.values())


def choose_sampler(engine: EngineBackend) -> UtilizationSampler:
    own = engine.utilization_sampler()
    if own is not None:
        return own
    try:
        import pynvml  # nvidia-ml-py; not a dependency: present on GPU machines with vLLM
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            return NvmlSampler(pynvml, visible_device_ids("CUDA_VISIBLE_DEVICES"))
        except Exception as exc:  # no driver, no GPU: try the next source
            logger.info("NVML not usable (%s); trying npu-smi", exc)
    binary = shutil.which("npu-smi")
    if binary:
        return NpuSmiSampler(binary, visible_device_ids("ASCEND_RT_VISIBLE_DEVICES"))
    logger.warning("no utilization source (NVML, npu-smi): every accelerator reading is 0%%")
    return IdleSampler()
