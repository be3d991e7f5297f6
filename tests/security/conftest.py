"""A development PKI made by motor/security/pki.py, and a real TLS server on 127.0.0.1:0 that serves every
Motor RPC with empty answers, so the access checks in front of it are what a test exercises."""

from __future__ import annotations

import datetime
import os

import pytest

from motor.security.identity import Identity
from motor.security.pki import CertificateAuthority
from motorctl.pki_command import DevPki, make_dev_pki
from tests.support.secure_services import mtls_files, policy, serve


@pytest.fixture(scope="session")
def dev_pki(tmp_path_factory) -> DevPki:
    return make_dev_pki(str(tmp_path_factory.mktemp("pki")), ["node-a", "node-b"])


@pytest.fixture(scope="session")
def odd_certs(tmp_path_factory, dev_pki) -> dict[str, tuple[str, str]]:
    """Certificates a server must refuse: expired, from another CA, without a Motor identity."""
    directory = str(tmp_path_factory.mktemp("odd"))
    ca = CertificateAuthority.load(dev_pki.directory)
    long_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=10)
    return {
        "expired": ca.issue(Identity("operator", "old"), [], days=1, not_before=long_ago).save(directory, "expired"),
        "other-ca": CertificateAuthority.create("another CA")
        .issue(Identity("operator", "eve"), [])
        .save(directory, "other"),
        "no-identity": ca.issue(None, ["localhost"]).save(directory, "plain"),
        "foreign-domain": ca.issue(Identity("operator", "x"), [], trust_domain="example.org").save(
            directory, "foreign"
        ),
    }


@pytest.fixture
async def mtls_server(dev_pki):
    """A mutual-TLS server with the controller's certificate, trusting the dev CA."""
    served = await serve(mtls_files(dev_pki), policy(dev_pki))
    yield served
    await served.server.stop(None)


os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
