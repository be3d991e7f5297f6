"""TLS to etcd: a real etcd member serving TLS only and requiring client certificates
(--client-cert-auth), a real controller process connecting with --etcd-ca/--etcd-cert/--etcd-key;
controllers without the right files exit with an error that names what to check."""

from __future__ import annotations

import datetime
import os
import subprocess
import time

import grpc
import pytest

from controller.store.etcd_client import EtcdTarget, connect
from motor.contract.deployment_file import load_deployment
from motor.ports import free_port
from motor.security.identity import Identity
from motor.security.pki import CertificateAuthority
from motor.v1 import controller_pb2, controller_pb2_grpc
from motorctl.cluster_processes import script_path
from motorctl.etcd_cluster import EtcdCluster, EtcdTls
from tests.support import REPO_ROOT, wait_for
from tests.support.etcd_members import _require_etcd

DEPLOYMENT = os.path.join(REPO_ROOT, "examples", "local-deployment.yaml")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> str:
    """The members' CA with a member certificate and a controller's; another CA's controller certificate."""
    directory = str(tmp_path_factory.mktemp("etcd-pki"))
    ca = CertificateAuthority.create()
    ca.save(directory)
    ca.issue(None, ["127.0.0.1", "localhost"]).save(directory, "etcd")
    ca.issue(Identity.parse("controller"), ["127.0.0.1"]).save(directory, "controller")
    CertificateAuthority.create().issue(Identity.parse("controller"), ["127.0.0.1"]).save(directory, "stranger")
    return directory


@pytest.fixture(scope="module")
def etcd_tls(tmp_path_factory, pki):
    _require_etcd()
    tls = EtcdTls(ca=f"{pki}/ca.crt", cert=f"{pki}/etcd.crt", key=f"{pki}/etcd.key")
    cluster = EtcdCluster(str(tmp_path_factory.mktemp("etcd-tls")), size=1, tls=tls)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        assert not any(m.running() for m in cluster.members)


def _leader_of(address: str, process: subprocess.Popen) -> controller_pb2.ListControllersResponse:
    with grpc.insecure_channel(address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)

        def answer():
            try:
                return stub.ListControllers(controller_pb2.ListControllersRequest(), timeout=2)
            except grpc.RpcError:
                return None

        return wait_for(
            lambda: (r := answer()) and r.leader_address and r,
            timeout=30,
            what=f"a leader seen by {address}; its log:\n{_output(process)}",
        )


def _controller(tmp_path, etcd: EtcdCluster, *flags: str) -> tuple[subprocess.Popen, str]:
    address = f"127.0.0.1:{free_port()}"
    log = open(tmp_path / f"controller-{address.rsplit(':', 1)[1]}.log", "w+")
    process = subprocess.Popen(
        [
            script_path("motor-controller"),
            "--listen",
            address,
            "--db",
            str(tmp_path / "unused.db"),
            "--store",
            f"{etcd.url}/tls-test",
            "--etcd-startup-wait",
            "3",
            "--metrics-port",
            "0",
            *flags,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    process.log = log  # type: ignore[attr-defined]
    return process, address


def _output(process: subprocess.Popen) -> str:
    process.log.seek(0)  # type: ignore[attr-defined]
    return process.log.read()  # type: ignore[attr-defined]


async def test_a_controller_leads_and_writes_over_mutual_tls(tmp_path, etcd_tls, pki):
    process, address = _controller(
        tmp_path,
        etcd_tls,
        "--etcd-ca",
        f"{pki}/ca.crt",
        "--etcd-cert",
        f"{pki}/controller.crt",
        "--etcd-key",
        f"{pki}/controller.key",
    )
    try:
        reply = _leader_of(address, process)
        assert reply.leader_address == address and reply.store.startswith("etcds://127.0.0.1:")
        with grpc.insecure_channel(address) as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            stub.ApplyDeployment(
                controller_pb2.ApplyDeploymentRequest(deployment=load_deployment(DEPLOYMENT)), timeout=10
            )
        member = etcd_tls.members[0]
        client = connect(
            EtcdTarget(
                ((member.host, member.client_port),),
                "/tls-test",
                f"{pki}/ca.crt",
                f"{pki}/controller.crt",
                f"{pki}/controller.key",
            )
        )
        try:
            stored = await client.get(b"/tls-test/state/deployments/local-sim")  # a deployment is kept under its name
            assert stored is not None and b"revision" in stored.value, "the deployment is in etcd"
        finally:
            await client.close()
    finally:
        process.terminate()
        assert process.wait(30) == 0, _output(process)


@pytest.mark.parametrize(
    "flags, expected",
    [
        ((), "if the members serve TLS, give --etcd-ca"),
        (
            ("--etcd-ca", "{pki}/ca.crt"),
            "refuse a caller without a client certificate: give --etcd-cert and --etcd-key",
        ),
        (
            ("--etcd-ca", "{pki}/ca.crt", "--etcd-cert", "{pki}/stranger.crt", "--etcd-key", "{pki}/stranger.key"),
            "a client certificate the members' --trusted-ca-file signed",
        ),
    ],
    ids=["plaintext", "no-client-certificate", "certificate-of-another-ca"],
)
def test_a_controller_without_the_right_files_exits_naming_them(tmp_path, etcd_tls, pki, flags, expected):
    process, _ = _controller(tmp_path, etcd_tls, *(flag.format(pki=pki) for flag in flags))
    assert process.wait(60) == 2, _output(process)
    output = _output(process)
    assert "--store: cannot read the state from etcd" in output and expected in output, output
    assert "Traceback" not in output, output


def test_three_members_over_tls_one_name_checked(tmp_path, pki):
    """Several endpoints share one gRPC channel, so TLS checks one name against every member:
    the first endpoint's host by default, or --etcd-server-name (here a name each member's
    certificate carries); a name no certificate carries is refused, and the error names the flag."""
    _require_etcd()
    tls = EtcdTls(ca=f"{pki}/ca.crt", cert=f"{pki}/etcd.crt", key=f"{pki}/etcd.key")
    cluster = EtcdCluster(str(tmp_path / "etcd"), size=3, tls=tls).start()
    client_files = (
        "--etcd-ca",
        f"{pki}/ca.crt",
        "--etcd-cert",
        f"{pki}/controller.crt",
        "--etcd-key",
        f"{pki}/controller.key",
    )
    started = []
    try:
        by_default, first = _controller(tmp_path, cluster, *client_files)
        named, second = _controller(tmp_path, cluster, *client_files, "--etcd-server-name", "localhost")
        wrong, _ = _controller(tmp_path, cluster, *client_files, "--etcd-server-name", "etcd.example")
        started = [by_default, named, wrong]
        leader = _leader_of(first, by_default).leader_address
        assert leader in (first, second) and _leader_of(second, named).leader_address == leader
        assert wrong.wait(60) == 2, _output(wrong)
        assert "must be valid for 'etcd.example' (--etcd-server-name)" in _output(wrong), _output(wrong)
    finally:
        for process in started:
            if process.poll() is None:
                process.terminate()
                process.wait(30)
        cluster.stop()


def test_a_renewed_client_certificate_is_used_without_a_restart(tmp_path, pki):
    """Short-lived client certificates (SPIRE, cert-manager): the controller's etcd client starts
    with one that expires 20 s later; a renewed pair lands on the same paths; once the first has
    expired, etcd is restarted (every connection opens again, with a handshake). The controller
    leads and writes again: it presented the renewed certificate. Before, the etcd client kept the
    files of its start, and every reconnect past the expiry was refused for good."""
    _require_etcd()
    ca = CertificateAuthority.load(pki)
    started = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=5)
    short = ca.issue(Identity.parse("controller"), ["127.0.0.1"], days=25 / 86400, not_before=started)
    short.save(str(tmp_path), "client")
    expires = short.certificate.not_valid_after_utc.timestamp()
    tls = EtcdTls(ca=f"{pki}/ca.crt", cert=f"{pki}/etcd.crt", key=f"{pki}/etcd.key")
    cluster = EtcdCluster(str(tmp_path / "etcd"), size=1, tls=tls).start()
    process = None
    try:
        process, address = _controller(
            tmp_path,
            cluster,
            "--etcd-ca",
            f"{pki}/ca.crt",
            "--etcd-cert",
            str(tmp_path / "client.crt"),
            "--etcd-key",
            str(tmp_path / "client.key"),
        )
        assert _leader_of(address, process).leader_address == address
        renewed = tmp_path / "renewed"
        renewed.mkdir()
        ca.issue(Identity.parse("controller"), ["127.0.0.1"]).save(str(renewed), "client")
        for name in ("client.key", "client.crt"):  # a rotation as a tool writes it: one file, then the other
            os.replace(renewed / name, tmp_path / name)
        time.sleep(max(0.0, expires - time.time() + 2))  # the certificate of its start has expired
        cluster.kill_member(0)
        cluster.start_member(0)
        cluster.wait_healthy()

        def applied() -> bool:
            try:
                with grpc.insecure_channel(address) as channel:
                    controller_pb2_grpc.ControllerServiceStub(channel).ApplyDeployment(
                        controller_pb2.ApplyDeploymentRequest(deployment=load_deployment(DEPLOYMENT)), timeout=5
                    )
                return True
            except grpc.RpcError:
                return False

        wait_for(
            applied,
            timeout=60,
            what=f"an apply stored in etcd after the restart; the controller's log:\n{_output(process)}",
        )
        assert "TLS certificate re-read from" in _output(process), _output(process)
    finally:
        if process is not None:
            process.terminate()
            assert process.wait(30) == 0, _output(process)
        cluster.stop()
