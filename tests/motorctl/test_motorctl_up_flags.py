"""`motorctl up --model-root/--accelerator-type/--accelerators`: what each node manager is
told, and the refusals that come before anything is started (no process here)."""

from __future__ import annotations

import os

import pytest

from motorctl import up
from motorctl.local_cluster import LocalCluster
from motorctl.up import accelerator_plan
from node_manager.accelerators import HostAccelerators
from tests.support import REPO_ROOT

VLLM_TINY = os.path.join(REPO_ROOT, "examples", "vllm-tiny.yaml")
SIM = os.path.join(REPO_ROOT, "examples", "local-deployment.yaml")


def host(ids: tuple[int, ...], found_type: str = "cpu"):
    """A stand-in for node_manager.accelerators.detect that finds `ids` of `found_type`."""
    return lambda kind: HostAccelerators(found_type, ids, "CPU affinity" if found_type == "cpu" else "NVML")


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_sim_nodes_get_four_simulated_accelerators_each_unless_told():
    assert accelerator_plan("sim", None, 2) == ("sim", 4, ())
    assert accelerator_plan("sim", 2, 3) == ("sim", 2, ())


def test_the_hosts_cores_are_shared_among_the_node_managers_without_overlap():
    found = host((0, 1, 2, 3, 4))
    assert accelerator_plan("cpu", None, 2, found) == ("cpu", 2, (0, 1, 2, 3, 4))
    cluster = LocalCluster(
        "/unused", nodes=2, accelerator_type="cpu", accelerators_per_node=2, host_accelerators=(0, 1, 2, 3, 4)
    )
    assert [cluster.node_accelerators(i) for i in range(2)] == [[0, 1], [2, 3]]
    argv = cluster.node_command("node-b", 1, 5000)
    assert flag(argv, "--accelerators") == "2,3" and flag(argv, "--accelerator-type") == "cpu"


def test_gpus_found_make_nvidia_nodes():
    assert accelerator_plan("auto", 1, 2, host((4, 5), "nvidia")) == ("nvidia", 1, (4, 5))


def test_more_devices_than_the_host_has_is_refused_naming_the_flags():
    with pytest.raises(ValueError, match=r"--accelerators 2 x --nodes 2 needs 4 CPU core\(s\), but this host has 2"):
        accelerator_plan("cpu", 2, 2, host((0, 1)))
    with pytest.raises(ValueError, match=r"--nodes 3: this host has 2 CPU core\(s\).*lower --nodes"):
        accelerator_plan("cpu", None, 3, host((0, 1)))
    with pytest.raises(ValueError, match=r"--accelerators 0: must be at least 1"):
        accelerator_plan("sim", 0, 1)


def test_model_roots_reach_every_node_manager():
    cluster = LocalCluster("/unused", nodes=2, model_roots=["/models", "/weights"])
    for index, node_id in enumerate(cluster.node_ids()):
        assert flag(cluster.node_command(node_id, index, 5000), "--model-roots") == "/models,/weights"
    assert "--model-roots" not in LocalCluster("/unused").node_command("node-a", 0, 5000)


def test_a_deployment_naming_a_local_path_no_model_root_holds_is_refused_before_anything_starts(capsys, tmp_path):
    with pytest.raises(SystemExit) as ended:
        up.main(["--deployment", VLLM_TINY, "--run-dir", str(tmp_path / "run")])
    assert ended.value.code == 2
    error = capsys.readouterr().err
    assert "engine_config.motor_engine_prefill_config.engine_args.model names the local path" in error, error
    assert "'/tmp/motor-models/tiny-llama', but no --model-root is given" in error
    assert "add --model-root DIR, a folder holding it (e.g. --model-root /tmp/motor-models)" in error
    with pytest.raises(SystemExit):
        up.main(["--deployment", VLLM_TINY, "--run-dir", str(tmp_path / "run"), "--model-root", str(tmp_path)])
    assert f"outside every --model-root ({tmp_path})" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing was started or wiped


def test_a_model_root_that_is_not_a_folder_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit) as ended:
        up.main(["--deployment", SIM, "--model-root", str(tmp_path / "missing")])
    assert ended.value.code == 2 and f"--model-root {tmp_path / 'missing'}: no such folder" in capsys.readouterr().err


def test_more_accelerators_than_the_machine_has_is_refused_by_motorctl_up(capsys):
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(SystemExit) as ended:
        up.main(["--deployment", SIM, "--accelerator-type", "cpu", "--accelerators", str(cores + 1), "--nodes", "1"])
    assert ended.value.code == 2 and f"--accelerators {cores + 1} x --nodes 1" in capsys.readouterr().err


def test_kv_routing_turns_on_the_controllers_kv_events_and_the_doors_kv_routing(monkeypatch, tmp_path):
    made: list[dict] = []

    class Made(Exception):
        pass

    def cluster(*args, **fields):
        made.append(fields)
        raise Made

    monkeypatch.setattr(up, "LocalCluster", cluster)
    for extra in ([], ["--kv-routing"]):
        with pytest.raises(Made):
            up.main(["--deployment", SIM, "--run-dir", str(tmp_path / "run"), *extra])
    plain, routed = made
    assert "--kv-events" not in plain["extra_controller_args"] and "--kv-routing" not in plain["door_args"]
    assert routed["extra_controller_args"] == ["--kv-events"] and routed["door_args"] == ["--kv-routing"]
