"""The development PKI (`motorctl pki`) and the tokens file."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from motor.errors import ConfigError, InvalidArgument
from motor.security.identity import Identity, identity_from_uri
from motor.security.tokens import TokenStore, write_tokens_file
from tests.support import REPO_ROOT


def motorctl(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    return subprocess.run(
        [sys.executable, "-m", "motorctl.cli", *args], capture_output=True, text=True, env=env, timeout=60
    )


def _load(path: str) -> x509.Certificate:
    with open(path, "rb") as handle:
        return x509.load_pem_x509_certificate(handle.read())


@pytest.mark.processes
def test_motorctl_pki_init_and_issue_make_a_verifiable_certificate_with_the_identity(tmp_path):
    directory = str(tmp_path / "pki")
    made = motorctl("pki", "init", "--dir", directory)
    assert made.returncode == 0, made.stderr
    again = motorctl("pki", "init", "--dir", directory)
    assert again.returncode == 2 and "already holds a CA" in again.stderr
    issued = motorctl(
        "pki",
        "issue",
        "node-a",
        "--dir",
        directory,
        "--identity",
        "node/node-a",
        "--host",
        "localhost",
        "--host",
        "10.0.0.7",
    )
    assert issued.returncode == 0, issued.stderr
    assert "spiffe://motor/node/node-a" in issued.stdout

    ca, cert = _load(f"{directory}/ca.crt"), _load(f"{directory}/node-a.crt")
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://motor/node/node-a"]
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usages)
    for secret in ("ca.key", "node-a.key"):
        assert stat.S_IMODE(os.stat(f"{directory}/{secret}").st_mode) == 0o600


@pytest.mark.parametrize(
    "identity, message",
    [
        ("node/Node-A", "lowercase"),
        ("node/nl\n", "lowercase"),
        ("admin/x", "not one of"),
        ("controller/x", "takes no name"),
    ],
)
@pytest.mark.processes
def test_motorctl_pki_issue_refuses_a_bad_identity(tmp_path, identity, message):
    directory = str(tmp_path)
    assert motorctl("pki", "init", "--dir", directory).returncode == 0
    refused = motorctl("pki", "issue", "x", "--dir", directory, "--identity", identity)
    assert refused.returncode == 2 and message in refused.stderr
    assert not os.path.exists(f"{directory}/x.crt")


@pytest.mark.processes
def test_motorctl_pki_dev_writes_the_cluster_set_and_reuses_its_ca(tmp_path):
    directory = str(tmp_path / "pki")
    assert motorctl("pki", "dev", "--dir", directory, "--nodes", "node-a,node-b,node-c").returncode == 0
    names = sorted(os.listdir(directory))
    for stem in ("controller", "node-a", "node-b", "node-c", "operator", "viewer"):
        assert f"{stem}.crt" in names and f"{stem}.key" in names
    assert {"ca.crt", "ca.key", "tokens.yaml", "operator.token", "viewer.token"} <= set(names)
    first_ca = _load(f"{directory}/ca.crt")
    assert motorctl("pki", "dev", "--dir", directory).returncode == 0
    assert _load(f"{directory}/ca.crt") == first_ca
    _load(f"{directory}/node-a.crt").verify_directly_issued_by(first_ca)
    store = TokenStore(f"{directory}/tokens.yaml")
    with open(f"{directory}/viewer.token") as handle:
        assert store.lookup(handle.read()).roles == ["viewer"]


def test_identities_parse_only_motor_uris_of_the_trust_domain():
    assert identity_from_uri("spiffe://motor/node/node-a") == Identity("node", "node-a")
    assert identity_from_uri("spiffe://motor/controller") == Identity("controller")
    assert identity_from_uri("spiffe://example.org/node/node-a") is None
    assert identity_from_uri("spiffe://example.org/node/node-a", trust_domain="example.org") == Identity(
        "node", "node-a"
    )
    for bad in (
        "spiffe://motor/node/",
        "spiffe://motor/node/a/b",
        "spiffe://motor/root",
        "https://motor/node/a",
        "spiffe://motor/node/a\n",
    ):
        assert identity_from_uri(bad) is None, bad
    with pytest.raises(InvalidArgument):
        Identity("node", "NODE")


def test_tokens_match_exactly_and_the_file_is_reread_when_it_changes(tmp_path):
    path = str(tmp_path / "tokens.yaml")
    first = write_tokens_file(path, {"alice": ["operator"], "bob": ["viewer"]})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    store = TokenStore(path)
    assert store.lookup(first["alice"]).name == "alice"
    assert store.lookup(first["bob"]).roles == ["viewer"]
    assert store.lookup(first["alice"][:-1]) is None
    assert store.lookup(first["alice"] + "x") is None
    assert store.lookup("") is None

    time.sleep(0.01)  # a distinct mtime; size and inode change too
    second = write_tokens_file(path, {"carol": ["viewer"]})
    assert store.lookup(first["alice"]) is None
    assert store.lookup(second["carol"]).name == "carol"

    with open(path, "w") as handle:  # a broken edit keeps the previous tokens
        handle.write("tokens: [{name: carol, roles: [root], token: short}]\n")
    assert store.lookup(second["carol"]).name == "carol"

    time.sleep(0.01)  # the viewer's token pasted under a new operator name: refused, previous kept
    with open(path, "w") as handle:
        handle.write(
            f"tokens: [{{name: carol, roles: [viewer], token: {second['carol']}}}, "
            f"{{name: mallory, roles: [operator], token: {second['carol']}}}]\n"
        )
    assert store.lookup(second["carol"]).roles == ["viewer"]


@pytest.mark.parametrize(
    "body, named",
    [
        ("tokens: [{name: a, roles: [admin], token: 0123456789abcdef}]", "tokens[0].roles[0]"),
        ("tokens: [{name: a, roles: [viewer], token: short}]", "tokens[0].token"),
        ("tokens: [{name: a, roles: [], token: 0123456789abcdef}]", "tokens[0].roles"),
        (
            "tokens: [{name: a, roles: [viewer], token: 0123456789abcdef}, {name: a, roles: [viewer], token: "
            "0123456789abcdeg}]",
            "appear twice",
        ),
        ("tokens: [{name: a, roles: [viewer], token: '0123456789 abcdef'}]", "no spaces"),
        (
            "tokens: [{name: bob, roles: [viewer], token: 0123456789abcdef}, {name: alice, roles: [operator], token: "
            "0123456789abcdef}]",
            "bob and alice have the same token",
        ),
    ],
)
def test_a_bad_tokens_file_is_refused_naming_the_field(tmp_path, body, named):
    path = tmp_path / "tokens.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError) as refused:
        TokenStore(str(path))
    assert named in str(refused.value) and "--tokens-file" in str(refused.value)
