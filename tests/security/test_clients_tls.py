"""The Go and JavaScript example clients over TLS: a client certificate or a bearer token, against
the access checks on a real TLS server (the services behind it answer empty messages)."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from motor.service.grpc_server import TlsFiles
from tests.support.client_builds import BUILDERS, DEPLOYMENT_JSON
from tests.support.secure_services import mtls_files, policy, serve

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def argv(request):
    return BUILDERS[request.param]()


@pytest.fixture(scope="module")
async def servers(dev_pki):
    mtls = await serve(mtls_files(dev_pki), policy(dev_pki))
    tokens = await serve(TlsFiles(cert=dev_pki.cert("controller"), key=dev_pki.key("controller")), policy(dev_pki))
    yield mtls, tokens
    await mtls.server.stop(None)
    await tokens.server.stop(None)


async def _run(argv, port, *args):
    go = argv[0].endswith("motor-go-client")
    flags = [a.replace("--", "-", 1) if go and a.startswith("--") else a for a in args]
    return await asyncio.to_thread(
        subprocess.run,
        [*argv, "-addr" if go else "--addr", f"localhost:{port}", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_a_client_certificate_carries_the_callers_role(argv, servers, dev_pki):
    mtls, _ = servers
    viewer = ["--cacert", dev_pki.ca, "--cert", dev_pki.cert("viewer"), "--key", dev_pki.key("viewer")]
    listed = await _run(argv, mtls.port, *viewer, "nodes")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == ["NODE", "STATE", "ADDRESS", "ENGINES", "REASON"]
    refused = await _run(argv, mtls.port, *viewer, "apply", DEPLOYMENT_JSON)
    assert refused.returncode == 1 and "PermissionDenied" in refused.stderr.replace(
        "PERMISSION_DENIED", "PermissionDenied"
    )
    assert "spiffe://motor/viewer/viewer" in refused.stderr and "needs role operator" in refused.stderr
    operator = ["--cacert", dev_pki.ca, "--cert", dev_pki.cert("operator"), "--key", dev_pki.key("operator")]
    before = mtls.services.calls.count("ApplyDeployment")
    applied = await _run(argv, mtls.port, *operator, "apply", DEPLOYMENT_JSON)
    assert applied.returncode == 0, applied.stderr
    assert mtls.services.calls.count("ApplyDeployment") == before + 1  # only the operator's reached the service


async def test_a_bearer_token_carries_the_callers_role(argv, servers, dev_pki):
    _, tokens = servers
    operator = ["--cacert", dev_pki.ca, "--token-file", dev_pki.token_file("operator")]
    applied = await _run(argv, tokens.port, *operator, "apply", DEPLOYMENT_JSON)
    assert applied.returncode == 0, applied.stderr
    viewer = ["--cacert", dev_pki.ca, "--token-file", dev_pki.token_file("viewer")]
    refused = await _run(argv, tokens.port, *viewer, "apply", DEPLOYMENT_JSON)
    assert refused.returncode == 1 and "token:viewer" in refused.stderr and "needs role operator" in refused.stderr
    anonymous = await _run(argv, tokens.port, "--cacert", dev_pki.ca, "nodes")
    assert (
        anonymous.returncode == 1
        and "no client certificate and no 'authorization: Bearer <token>' header" in anonymous.stderr
    )


async def test_plaintext_against_a_tls_server_fails_to_connect(argv, servers):
    mtls, _ = servers
    result = await _run(argv, mtls.port, "nodes")
    assert result.returncode == 1 and "cannot connect" in result.stderr
