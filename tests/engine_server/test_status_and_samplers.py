"""The status machine and the utilization samplers, in-process."""

from __future__ import annotations

import os
import stat

import pytest

from engine_server.engines.base import EngineOptions
from engine_server.engines.sim import SimEngine
from engine_server.samplers import IdleSampler, NpuSmiSampler, choose_sampler, parse_npu_smi_info, visible_device_ids
from engine_server.status import Event, Health, HealthStateMachine

# `npu-smi info` of an 8-NPU Atlas 800I A2 (910B), in the format Huawei documents for npu-smi 23.x.
# Not captured on this machine (there is no NPU here): reproduced from that documented format.
NPU_SMI_INFO = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.6                   Version: 23.0.6                                               |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 97.3        37                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3398 / 65536         |
+===========================+===============+====================================================+
| 1     910B3               | OK            | 93.5        36                0    / 0             |
| 0                         | 0000:C2:00.0  | 87          0    / 0          60110/ 65536         |
+===========================+===============+====================================================+
| 2     910B3               | OK            | 98.1        37                0    / 0             |
| 0                         | 0000:81:00.0  | 12.5        0    / 0          3398 / 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| No running processes found in NPU 0                                                            |
+===========================+===============+====================================================+
"""


def test_state_machine_transitions_carry_reasons():
    machine = HealthStateMachine()
    seen = []
    machine.on_transition(seen.append)
    assert machine.state is Health.INIT and "GET /health" in machine.reason
    assert not machine.fire(Event.FAILURE_LIMIT, "ignored while starting")
    assert machine.fire(Event.HEALTH_UP, "up")
    assert not machine.fire(Event.PROBE_SUCCEEDED, "nothing to recover from")
    assert machine.fire(Event.FAILURE_LIMIT, "6 failures")
    assert machine.fire(Event.PROBE_SUCCEEDED, "back")
    assert [(t.before, t.after, t.reason) for t in seen] == [
        (Health.INIT, Health.NORMAL, "up"),
        (Health.NORMAL, Health.ABNORMAL, "6 failures"),
        (Health.ABNORMAL, Health.NORMAL, "back"),
    ]


def test_engine_death_is_final():
    machine = HealthStateMachine()
    machine.fire(Event.HEALTH_UP, "up")
    assert machine.fire(Event.ENGINE_DIED, "engine core exited with 1")
    assert machine.state is Health.ABNORMAL and machine.dead
    assert not machine.fire(Event.PROBE_SUCCEEDED, "a late probe")
    assert machine.state is Health.ABNORMAL and machine.reason == "engine core exited with 1"


def test_npu_smi_parser_reads_aicore_utilization():
    assert parse_npu_smi_info(NPU_SMI_INFO) == {0: 0.0, 1: 87.0, 2: 12.5}
    assert parse_npu_smi_info("npu-smi: command failed") == {}


@pytest.fixture
def fake_npu_smi(tmp_path):
    """A real executable named npu-smi that prints the sample (the sampler runs it as a process)."""
    sample = tmp_path / "sample.txt"
    sample.write_text(NPU_SMI_INFO)
    binary = tmp_path / "npu-smi"
    binary.write_text(f'#!/bin/sh\n[ "$1" = info ] || exit 3\ncat {sample}\n')
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return binary


@pytest.mark.processes
async def test_npu_smi_sampler_takes_the_peak_of_its_devices(fake_npu_smi):
    assert await NpuSmiSampler(str(fake_npu_smi)).sample() == 87.0
    assert await NpuSmiSampler(str(fake_npu_smi), device_ids=[0, 2]).sample() == 12.5
    with pytest.raises(RuntimeError, match="no NPU utilization"):
        await NpuSmiSampler(str(fake_npu_smi), device_ids=[7]).sample()


def test_visible_device_ids(monkeypatch):
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,2")
    assert visible_device_ids("ASCEND_RT_VISIBLE_DEVICES") == [0, 2]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5f1c,GPU-77aa")
    assert visible_device_ids("CUDA_VISIBLE_DEVICES") is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_device_ids("CUDA_VISIBLE_DEVICES") is None


def _engine():
    return SimEngine(
        EngineOptions(role="prefill", instance_id="p", dp_rank=0, host="127.0.0.1", port=1, master_dp_ip="x")
    )


def test_choose_sampler_prefers_the_engines_own_then_npu_smi_then_idle(monkeypatch, fake_npu_smi):
    assert choose_sampler(_engine()).name == "sim"

    class Plain(SimEngine):
        def utilization_sampler(self):
            return None

    plain = Plain(_engine().options)
    monkeypatch.setenv("PATH", str(fake_npu_smi.parent) + os.pathsep + os.environ["PATH"])
    assert isinstance(choose_sampler(plain), NpuSmiSampler)  # (pynvml is not installed here)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert isinstance(choose_sampler(plain), IdleSampler)


async def test_nvml_sampler_logic_with_a_stand_in_module():
    """NVML's calls and the peak over the visible GPUs; real NVML is not on this machine (no GPU)."""
    from types import SimpleNamespace

    from engine_server.samplers import NvmlSampler

    readings = {0: 10, 1: 85, 2: 40}
    fake = SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 3,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetUtilizationRates=lambda handle: SimpleNamespace(gpu=readings[handle], memory=0),
    )
    assert await NvmlSampler(fake).sample() == 85
    assert await NvmlSampler(fake, device_ids=[0, 2]).sample() == 40
    with pytest.raises(RuntimeError, match="none of them"):
        NvmlSampler(fake, device_ids=[5])
