"""Who may use `motorctl up`'s front door: open on loopback (the default), API keys and TLS from
the operator's files (`--api-keys`, `--tls-cert`/`--tls-key`), or a development key and
certificate made for this run (`--secure-door`; docs/security.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import yaml

from front_door.keys import digest, new_key
from motor.engine_key import ENGINE_KEY_ENV, new_engine_key
from motor.security.pki import CertificateAuthority, write_private

DEV_TENANT = "dev"
ENGINE_KEY_FILE = "engine-api-key"


@dataclass
class DoorAccess:
    api_keys: str | None = None  # the key file (or directory)
    tls_cert: str | None = None
    tls_key: str | None = None
    ca: str | None = None  # the CA clients trust the door's certificate by (a development one)
    dev_key: str | None = None  # where a development key is kept for the operator (0600)
    engine_key: str | None = None  # the engines' own key (motor/engine_key.py), with a keyed door

    def engine_env(self, run_dir: str) -> dict[str, str]:
        """The engines' key in the environment of the cluster's processes (the node managers' engines
        inherit it), when the door takes keys: an open door is nothing to go around. Kept in
        <run_dir>/engine-api-key (0600), for an operator who must reach an engine directly."""
        if not self.api_keys:
            return {}
        if self.engine_key is None:
            self.engine_key = kept_engine_key(os.path.join(run_dir, ENGINE_KEY_FILE))
        return {ENGINE_KEY_ENV: self.engine_key}

    def args(self) -> list[str]:
        """The front door's flags (front_door/cli.py)."""
        flags = ["--api-keys", self.api_keys] if self.api_keys else []
        if self.tls_cert:
            flags += ["--tls-cert", self.tls_cert, "--tls-key", self.tls_key]
        return flags

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def note(self) -> str:
        """What the screen says of the door's access."""
        if not self.api_keys and not self.tls:
            return "OPEN: no API keys, plain HTTP, on loopback only (motorctl up --secure-door: keys and TLS)"
        said = [f"API keys: {self.api_keys}" if self.api_keys else "no API keys"]
        said.append("TLS" + (f" (trust {self.ca})" if self.ca else "") if self.tls else "plain HTTP")
        if self.dev_key:
            said.append(f"key in {self.dev_key}")
        return "; ".join(said)

    def how_to(self, url: str) -> str:
        """How to call the door, for the operator (printed at start)."""
        lines = [f"The front door at {url}/v1 takes API keys (and TLS) only:"]
        if self.dev_key:
            lines.append(f"  export OPENAI_API_KEY=$(cat {self.dev_key}) OPENAI_BASE_URL={url}/v1")
        if self.ca:
            lines.append(f"  export SSL_CERT_FILE={self.ca}    # OpenAI's Python client trusts the development CA")
        key = '"$OPENAI_API_KEY"' if self.dev_key else "YOUR_KEY"
        cacert = f" --cacert {self.ca}" if self.ca else ""
        lines.append(f'  curl{cacert} {url}/v1/models -H "Authorization: Bearer {key}"')
        return "\n".join(lines)


def development_access(run_dir: str) -> DoorAccess:
    """A key of tenant `dev` (every model, no limits) and a certificate for 127.0.0.1 and localhost
    signed by a CA made for this run, under <run_dir>/door; the key itself kept there (0600) for
    the operator, its sha256 in the key file."""
    directory = os.path.join(run_dir, "door")
    os.makedirs(directory, exist_ok=True)
    ca = CertificateAuthority.create("Motor development CA (front door)")
    ca_cert, _ = ca.save(directory)
    cert, key = ca.issue(None, hosts=["127.0.0.1", "localhost"]).save(directory, "door")
    api_keys, dev_key = write_dev_keys(directory)
    return DoorAccess(api_keys, cert, key, ca_cert, dev_key)


def write_dev_keys(directory: str) -> tuple[str, str]:
    """A fresh key of tenant `dev` (every model, no limits): the key itself in <directory>/api-key
    (0600, for the operator), its sha256 in <directory>/api-keys.yaml (the door's --api-keys)."""
    secret = new_key()
    dev_key = os.path.join(directory, "api-key")
    write_private(dev_key, secret.encode() + b"\n")
    keys = {
        "tenants": {DEV_TENANT: {"models": ["*"]}},
        "keys": [{"id": "dev-1", "tenant": DEV_TENANT, "sha256": digest(secret).hex()}],
    }
    api_keys = os.path.join(directory, "api-keys.yaml")
    write_private(api_keys, yaml.safe_dump(keys, sort_keys=False).encode())
    return api_keys, dev_key


def kept_engine_key(path: str, mode: int = 0o600) -> str:
    """The engines' key (motor/engine_key.py) kept in `path`, made there (readable by its owner
    only: `mode`) when there is none: a run or stack started again keeps the key its engines hold."""
    if os.path.exists(path):
        with open(path) as held:
            return held.read().strip()
    key = new_engine_key()
    write_private(path, key.encode() + b"\n")
    os.chmod(path, mode)
    return key
