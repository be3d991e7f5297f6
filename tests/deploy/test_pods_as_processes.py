"""The Kubernetes base's containers run as processes on this machine, with the probes the manifests
give them: each container's command as rendered by kustomize, its $(VAR)s from the environment
the pod spec gives it (the downward API's values are this machine's: node and pod address
127.0.0.1), its settings files from the ConfigMap, its Secrets as files named as cert-manager
names them, one directory per pod in place of its mounts, free ports in place of the fixed ones.
The probes' verdicts are asked the way the kubelet would: the exec probes run, the httpGet probes
fetched. A deployment then serves a completion through the front door. What this does not run: a
kubelet, an API server, a container runtime, the network policies (docs/kubernetes.md)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request

import psutil
import pytest
import yaml

from motor.ports import free_port
from motor.security.identity import Identity
from motor.security.pki import CertificateAuthority
from motorctl.etcd_cluster import EtcdCluster, EtcdTls
from tests.support import require, wait_for
from tests.support.deploy_tools import DEPLOYMENT, config_map, find, http, render, venv_tool

pytestmark = [pytest.mark.processes, pytest.mark.slow]

FIXED_PORTS = ("50051", "50052", "8079", "8080", "8081", "29000")


class Pod:
    """One pod's containers as processes: its mounts under `root`, its environment resolved."""

    def __init__(self, workload: dict, root: str, env: dict[str, str], ports: dict[str, int], files: dict[str, dict]):
        self.workload, self.root, self.ports = workload, root, ports
        self.spec = workload["spec"]["template"]["spec"]
        self.env = env
        volumes = {v["name"]: v for v in self.spec["volumes"]}
        for container in self.spec["containers"]:
            for mount in container.get("volumeMounts", []):
                target = self.path(mount["mountPath"])
                os.makedirs(target, exist_ok=True)
                volume = volumes[mount["name"]]
                source = volume.get("configMap", {}).get("name") or volume.get("secret", {}).get("secretName")
                for name, text in files.get(source, {}).items():
                    with open(os.path.join(target, name), "w") as handle:
                        handle.write(self.moved(text))

    def path(self, path: str) -> str:
        return self.root + path

    def moved(self, text: str) -> str:
        """Paths under the pod's mounts moved under its root; fixed ports made free ones."""
        mounts = sorted({m["mountPath"] for c in self.spec["containers"] for m in c.get("volumeMounts", [])}, key=len)
        pattern = "|".join(re.escape(m) for m in reversed(mounts))
        text = re.sub(rf"(?<![\w/.-])({pattern})(?![\w.-])", lambda m: self.path(m[1]), text)  # one pass
        for fixed, port in self.ports.items():
            text = re.sub(rf"(?<=:){fixed}\b|^{fixed}$", str(port), text)
        return text

    def container_env(self, container: dict) -> dict[str, str]:
        values = {}
        for entry in container.get("env", []):
            if "value" in entry:
                values[entry["name"]] = self.moved(entry["value"])
            else:
                values[entry["name"]] = self.env[entry["name"]]
        return values

    def argv(self, container: dict, command: list[str]) -> list[str]:
        env = self.container_env(container)
        argv = [self.moved(re.sub(r"\$\(([A-Z_]+)\)", lambda m: env[m[1]], a)) for a in command]
        if argv[0] == "python":
            return [sys.executable, *argv[1:]]
        tool = venv_tool(argv[0])
        require(tool is not None, f"{argv[0]} (make setup)")
        return [tool, *argv[1:]]

    def start(self, logs) -> list[subprocess.Popen]:
        started = []
        for container in self.spec["containers"]:
            log = open(logs / f"{self.workload['metadata']['name']}-{container['name']}.log", "w")
            started.append(
                subprocess.Popen(
                    self.argv(container, container["command"]),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **self.container_env(container)},
                    cwd=self.root,
                )
            )
        return started

    def probe(self, container_name: str, kind: str) -> bool:
        container = next(c for c in self.spec["containers"] if c["name"] == container_name)
        probe = container[kind]
        if "exec" in probe:
            done = subprocess.run(
                self.argv(container, probe["exec"]["command"]),
                capture_output=True,
                timeout=probe.get("timeoutSeconds", 1) + 10,
                env={**os.environ, **self.container_env(container)},
            )
            return done.returncode == 0
        if "httpGet" in probe:
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            port = self.ports[str(ports.get(probe["httpGet"]["port"], probe["httpGet"]["port"]))]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{probe['httpGet']['path']}", timeout=5) as reply:
                    return 200 <= reply.status < 400
            except OSError:
                return False
        raise AssertionError(f"{container_name} {kind}: a probe this test does not run")


def test_the_bases_pods_run_pass_their_probes_and_serve(tmp_path):
    objects = render("base")
    ca = CertificateAuthority.create()
    leaves = {
        "motor-controller-tls": ca.issue(Identity.parse("controller"), ["127.0.0.1", "motor-controller"]),
        "motor-router-sync-tls": ca.issue(Identity.parse("router-sync/router-sync"), []),
        "node": ca.issue(Identity.parse("node/host-a"), ["127.0.0.1"]),
        "operator": ca.issue(Identity.parse("operator/operator"), []),
        "motor-etcd-tls": ca.issue(None, ["127.0.0.1", "motor-etcd"]),
    }
    pems = tmp_path / "pems"
    pems.mkdir()
    ca.save(str(pems))
    files: dict[str, dict] = {}
    for name, leaf in leaves.items():
        leaf.save(str(pems), name)
        read = lambda suffix, n=name: (pems / f"{n}.{suffix}").read_text()  # noqa: E731
        files[name] = {"tls.crt": read("crt"), "tls.key": read("key"), "ca.crt": (pems / "ca.crt").read_text()}
    configs = config_map(objects, "motor-config")
    files[configs["metadata"]["name"]] = dict(configs["data"])
    # The node's certificate is a hostPath on the node (docs/kubernetes.md): lay it out as the operator would.
    ports = {p: free_port() for p in FIXED_PORTS}
    etcd = EtcdCluster(
        str(tmp_path / "etcd"),
        size=1,
        tls=EtcdTls(
            ca=str(pems / "ca.crt"), cert=str(pems / "motor-etcd-tls.crt"), key=str(pems / "motor-etcd-tls.key")
        ),
    )
    controller = f"127.0.0.1:{ports['50051']}"
    env = {
        "POD_NAME": "motor-controller-0",
        "POD_IP": "127.0.0.1",
        "NODE_NAME": "host-a",
        "NODE_IP": "127.0.0.1",
        "MOTOR_ETCD_MEMBERS": etcd.url.removeprefix("etcd://"),
        "MOTOR_CONTROLLERS": controller,
    }
    # Each pod's own settings: the ConfigMap's, with free metrics ports (9471/9472 may be taken here).
    for name in ("controller.yaml", "node-manager.yaml"):
        values = yaml.safe_load(files[configs["metadata"]["name"]][name])
        values["metrics_port"] = 0
        files[configs["metadata"]["name"]][name] = yaml.safe_dump(values)
    pods = {
        name: Pod(find(objects, kind, name), str(tmp_path / name), env, ports, files)
        for kind, name in (
            ("StatefulSet", "motor-controller"),
            ("DaemonSet", "motor-node-manager"),
            ("Deployment", "motor-front-door"),
        )
    }
    node = pods["motor-node-manager"]
    for volume in node.spec["volumes"]:  # hostPath volumes: the node's certificate and model cache
        if "hostPath" in volume:
            mount = next(m for m in node.spec["containers"][0]["volumeMounts"] if m["name"] == volume["name"])
            if volume["name"] == "pki":
                for file, text in files["node"].items():
                    (tmp_path / "motor-node-manager" / mount["mountPath"].lstrip("/") / file).write_text(text)
    logs = tmp_path / "logs"
    logs.mkdir()
    started: list[subprocess.Popen] = []

    def detail() -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-2500:]}" for f in sorted(logs.iterdir()))

    operator = [venv_tool("motorctl"), "--controller", controller, "--cacert", str(pems / "ca.crt")]
    operator += ["--cert", str(pems / "operator.crt"), "--key", str(pems / "operator.key")]
    etcd.start()
    try:
        for pod in pods.values():
            started += pod.start(logs)
        for name, container, kinds in (
            ("motor-controller", "controller", ("startupProbe", "readinessProbe", "livenessProbe")),
            ("motor-node-manager", "node-manager", ("startupProbe", "readinessProbe", "livenessProbe")),
            ("motor-front-door", "router", ("readinessProbe", "livenessProbe")),
            ("motor-front-door", "front-door", ("livenessProbe",)),
        ):
            for kind in kinds:
                wait_for(
                    lambda: pods[name].probe(container, kind),  # noqa: B023
                    timeout=90,
                    interval=1,
                    what=f"{name}/{container} {kind} to pass",
                    detail=detail,
                )
        path = tmp_path / "deployment.yaml"
        path.write_text(yaml.safe_dump(DEPLOYMENT))
        subprocess.run([*operator, "apply", "-f", str(path)], check=True, capture_output=True, timeout=60)
        door = pods["motor-front-door"]
        # Ready once its sync told it what is served; the sync ready once that table is fresh.
        for container in ("front-door", "router-sync"):
            wait_for(
                lambda: door.probe(container, "readinessProbe"),  # noqa: B023
                timeout=90,
                interval=1,
                what=f"front door's {container} readiness",
                detail=detail,
            )
        url = f"http://127.0.0.1:{ports['8080']}"
        wait_for(
            lambda: [m["id"] for m in http("GET", f"{url}/v1/models")[1].get("data", [])] == ["sim-tiny"],
            timeout=90,
            interval=0.5,
            what="the front door serving sim-tiny",
            detail=detail,
        )
        status, answer = http("POST", f"{url}/v1/completions", {"model": "sim-tiny", "prompt": "hi", "max_tokens": 4})
        assert status == 200 and answer["choices"], answer
        # A stopped node manager fails its probe (the kubelet would restart it).
        started[1].send_signal(signal.SIGTERM)
        started[1].wait(timeout=30)
        assert not pods["motor-node-manager"].probe("node-manager", "livenessProbe")
    finally:
        for process in reversed(started):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in reversed(started):
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        etcd.stop()
        # The engines were the node manager's children in its container; here they outlive it.
        root = str(tmp_path)
        left = [p for p in psutil.process_iter(["cmdline"]) if any(root in a for a in (p.info["cmdline"] or []))]
        for p in left:
            p.kill()
