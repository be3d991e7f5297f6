"""What `--accelerator-type auto` (node manager) and `motorctl up --accelerator-type` find on a
host: its GPUs (CUDA_VISIBLE_DEVICES, else NVML's count), else its CPU cores. No GPU here: NVML's
count is given by a stand-in; CUDA_VISIBLE_DEVICES and the CPU cores are the real ones."""

from __future__ import annotations

import os

import pytest

from motor.errors import ConfigError
from node_manager import accelerators
from node_manager.cli import load_config

CORES = tuple(sorted(os.sched_getaffinity(0)))


def test_cuda_visible_devices_names_the_gpus_and_an_empty_one_names_none():
    assert accelerators.host_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}, lambda: 8) == (2, 3)
    assert accelerators.host_gpus({"CUDA_VISIBLE_DEVICES": ""}, lambda: 8) == ()
    assert accelerators.host_gpus({}, lambda: 2) == (0, 1)  # unset: NVML's count


def test_gpu_uuids_in_cuda_visible_devices_are_refused_naming_what_to_give():
    with pytest.raises(ConfigError, match=r"CUDA_VISIBLE_DEVICES='GPU-5f1c'.*--accelerators"):
        accelerators.host_gpus({"CUDA_VISIBLE_DEVICES": "GPU-5f1c"}, lambda: 1)


def test_auto_takes_the_gpus_when_there_are_some_else_the_cpu_cores():
    found = accelerators.detect("auto", {}, lambda: 2)
    assert (found.type, found.ids, found.source) == ("nvidia", (0, 1), "NVML")
    found = accelerators.detect("auto", {"CUDA_VISIBLE_DEVICES": "1"}, lambda: 4)
    assert (found.type, found.ids, found.source) == ("nvidia", (1,), "CUDA_VISIBLE_DEVICES")
    found = accelerators.detect("auto", {}, lambda: 0)
    assert (found.type, found.ids) == ("cpu", CORES)


def test_gpu_on_a_host_without_one_is_refused_naming_the_alternatives():
    with pytest.raises(ConfigError, match=r"no GPU found.*use cpu .*or sim"):
        accelerators.detect("gpu", {}, lambda: 0)


def test_cpu_is_the_cores_this_process_may_run_on_even_with_gpus():
    assert accelerators.detect("cpu", {}, lambda: 8).ids == CORES


def test_this_machine_has_no_gpu_so_the_real_detection_gives_cpu_cores(monkeypatch):
    """The real NVML path (pynvml absent here), as the node manager runs it."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert accelerators.nvml_gpu_count() == 0
    assert accelerators.detect("auto") == accelerators.HostAccelerators("cpu", CORES, "CPU affinity")


def test_node_manager_auto_resolves_to_a_type_and_all_the_devices_unless_some_are_named(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = load_config(["--node-id", "n1", "--accelerator-type", "auto", "--state-dir", str(tmp_path)])
    assert (config.accelerator_type, config.accelerators) == ("cpu", list(CORES))
    config = load_config(
        ["--node-id", "n1", "--accelerator-type", "auto", "--accelerators", "0", "--state-dir", str(tmp_path)]
    )
    assert (config.accelerator_type, config.accelerators) == ("cpu", [0])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    config = load_config(["--node-id", "n1", "--accelerator-type", "auto", "--state-dir", str(tmp_path)])
    assert (config.accelerator_type, config.accelerators) == ("nvidia", [3, 5])


def test_node_manager_auto_with_unreadable_gpu_names_is_a_configuration_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5f1c")
    with pytest.raises(ConfigError, match=r"accelerator_type.*CUDA_VISIBLE_DEVICES='GPU-5f1c'"):
        load_config(["--node-id", "n1", "--accelerator-type", "auto", "--state-dir", str(tmp_path)])


def test_nvidia_visible_devices_from_the_device_plugin_are_the_containers_gpus_from_0():
    """Kubernetes' NVIDIA device plugin hands a pod its GPUs as NVIDIA_VISIBLE_DEVICES (UUIDs, or
    host indices); the container runtime shows exactly those, numbered 0..n-1 inside."""
    uuids = {"NVIDIA_VISIBLE_DEVICES": "GPU-5f1c0a2e,GPU-77aa91b3"}
    assert accelerators.host_gpus(uuids, lambda: 8) == (0, 1)
    assert accelerators.host_gpus({"NVIDIA_VISIBLE_DEVICES": "3"}, lambda: 8) == (0,)
    assert accelerators.host_gpus({"NVIDIA_VISIBLE_DEVICES": "all"}, lambda: 2) == (0, 1)  # NVML counts
    for none in ("none", "void", ""):
        assert accelerators.host_gpus({"NVIDIA_VISIBLE_DEVICES": none}, lambda: 8) == ()
    # CUDA_VISIBLE_DEVICES, set inside the container, narrows further and wins.
    assert accelerators.host_gpus({**uuids, "CUDA_VISIBLE_DEVICES": "1"}, lambda: 8) == (1,)
    found = accelerators.detect("auto", uuids, lambda: 8)
    assert (found.type, found.ids, found.source) == ("nvidia", (0, 1), "NVIDIA_VISIBLE_DEVICES")


def test_node_manager_gpu_takes_the_assigned_gpus_and_refuses_a_node_without_any(monkeypatch, tmp_path):
    """`--accelerator-type gpu` (the Kubernetes gpu overlay): a GPU pod whose devices did not reach
    it must stop with a configuration error, not serve on its CPU cores as `auto` would."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "GPU-5f1c0a2e,GPU-77aa91b3")
    config = load_config(["--node-id", "n1", "--accelerator-type", "gpu", "--state-dir", str(tmp_path)])
    assert (config.accelerator_type, config.accelerators) == ("nvidia", [0, 1])
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "void")
    with pytest.raises(ConfigError, match=r"accelerator_type gpu: .*no GPU found"):
        load_config(["--node-id", "n1", "--accelerator-type", "gpu", "--state-dir", str(tmp_path)])
