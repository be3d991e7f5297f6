"""API keys at the front door, the OpenAI way (`Authorization: Bearer <key>`; docs/security.md).

The key file (YAML; a directory of such files, as a Kubernetes secret mounts, is read as one)
names tenants, what each may use and its limits, and the keys of each, stored as the sha256 of the
key, never the key itself:

    tenants:
      acme:
        models: ["sim-tiny", "sim-tiny-lora-*"]   # names or fnmatch patterns; ["*"]: every model
        limits: {requests_per_minute: 600, tokens_per_minute: 200000, concurrent_requests: 16}
    keys:
      - id: acme-prod-1            # named in logs and metrics; never the key
        tenant: acme
        sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08

A key is a high-entropy random token (`python -m front_door.keys new`), so one sha256 is enough:
there is no password to guess that a slow KDF would protect. A request's key is hashed once,
looked up by its hash and compared with the stored hash in constant time (hmac.compare_digest).
The file is read again when it changes (checked every half second) or on SIGHUP: a revoked key
is refused within a second, and no connection is dropped. A file that does not load leaves the
keys as they were (logged, counted).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import logging
import os
import re
import secrets
import sys
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import yaml

logger = logging.getLogger(__name__)

# libyaml's parser where PyYAML was built with it (its wheels are): 10,000 keys read in about a
# fifth of the pure-Python parser's time.
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

KEY_PREFIX = "sk-motor-"
SHA256 = re.compile(r"^[0-9a-f]{64}$")
ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
LIMITS = ("requests_per_minute", "tokens_per_minute", "concurrent_requests")
MAX_MODEL_CACHE = 4096  # model names a tenant's answers are remembered for


class KeyFileError(ValueError):
    """A key file that does not load: the reason names the file and the entry, never a key."""


@dataclass(frozen=True)
class Limits:
    requests_per_minute: float | None = None  # None: no limit
    tokens_per_minute: float | None = None
    concurrent_requests: int | None = None


@dataclass(eq=False)
class Tenant:
    name: str
    models: tuple[str, ...] = ("*",)
    limits: Limits = field(default_factory=Limits)
    _allowed: dict[str, bool] = field(default_factory=dict, repr=False)

    def may_use(self, model: str) -> bool:
        """Whether this tenant may use `model` (a model or an adapter, by name or pattern)."""
        allowed = self._allowed.get(model)
        if allowed is None:
            allowed = any(pattern == "*" or fnmatchcase(model, pattern) for pattern in self.models)
            if len(self._allowed) < MAX_MODEL_CACHE:
                self._allowed[model] = allowed
        return allowed


@dataclass(frozen=True)
class Key:
    id: str
    tenant: Tenant
    digest: bytes  # sha256 of the key


def digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def new_key() -> str:
    """A fresh key: 256 random bits."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def _limits(where: str, raw: object) -> Limits:
    if raw is None:
        return Limits()
    if not isinstance(raw, dict) or not set(raw) <= set(LIMITS):
        raise KeyFileError(f"{where}: `limits` takes {', '.join(LIMITS)}")
    values = {}
    for name, value in raw.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise KeyFileError(f"{where}: `limits.{name}` must be a number above 0 (leave it out: no limit)")
        values[name] = int(value) if name == "concurrent_requests" else float(value)
    return Limits(**values)


def parse(documents: list[tuple[str, object]]) -> dict[bytes, Key]:
    """The keys by digest, from (file name, its YAML) pairs read as one file."""
    tenants: dict[str, Tenant] = {}
    entries: list[tuple[str, dict]] = []
    for name, document in documents:
        if document is None:
            continue
        if not isinstance(document, dict) or not set(document) <= {"tenants", "keys"}:
            raise KeyFileError(f"{name}: give `tenants:` and `keys:`")
        for tenant, raw in (document.get("tenants") or {}).items():
            where = f"{name}: tenant {tenant!r}"
            if not isinstance(tenant, str) or not ID.match(tenant):
                raise KeyFileError(f"{name}: a tenant's name is 1-64 letters, digits, '.', '_' or '-'")
            if tenant in tenants:
                raise KeyFileError(f"{where} is named twice")
            raw = raw or {}
            if not isinstance(raw, dict) or not set(raw) <= {"models", "limits"}:
                raise KeyFileError(f"{where}: takes `models` and `limits`")
            models = raw.get("models", ["*"])
            if not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models):
                raise KeyFileError(f'{where}: `models` is a list of model names or patterns (["*"]: every model)')
            tenants[tenant] = Tenant(tenant, tuple(models), _limits(where, raw.get("limits")))
        keys = document.get("keys") or []
        if not isinstance(keys, list):
            raise KeyFileError(f"{name}: `keys` is a list")
        entries.extend((name, entry) for entry in keys)
    found: dict[bytes, Key] = {}
    ids: set[str] = set()
    for index, (name, entry) in enumerate(entries):
        where = f"{name}: key {index + 1}"
        if not isinstance(entry, dict) or not set(entry) <= {"id", "tenant", "sha256"}:
            raise KeyFileError(f"{where}: give `id`, `tenant` and `sha256` (the key itself is never stored)")
        key_id, tenant, hashed = entry.get("id"), entry.get("tenant"), str(entry.get("sha256", "")).lower()
        if not isinstance(key_id, str) or not ID.match(key_id):
            raise KeyFileError(f"{where}: `id` is 1-64 letters, digits, '.', '_' or '-'")
        if key_id in ids:
            raise KeyFileError(f"{where}: the id {key_id!r} is used twice")
        if tenant not in tenants:
            raise KeyFileError(f"{where} ({key_id}): tenant {tenant!r} is not under `tenants`")
        if not SHA256.match(hashed):
            raise KeyFileError(f"{where} ({key_id}): `sha256` is the key's sha256, 64 hex digits")
        raw = bytes.fromhex(hashed)
        if raw in found:
            raise KeyFileError(f"{where} ({key_id}): the same key as {found[raw].id}")
        ids.add(key_id)
        found[raw] = Key(key_id, tenants[tenant], raw)
    if not found:  # (an empty file is also what a write caught half-way looks like)
        where = ", ".join(name for name, _ in documents) or "the key file"
        raise KeyFileError(
            f"{where}: no key in it: the door would refuse every client (make one: python -m front_door.keys new)"
        )
    return found


def files_of(path: str) -> list[str]:
    """The file, or a directory's files (not those whose name begins with '.': a Kubernetes
    secret's `..data` links), sorted."""
    if not os.path.isdir(path):
        return [path]
    return sorted(
        os.path.join(path, name)
        for name in os.listdir(path)
        if not name.startswith(".") and os.path.isfile(os.path.join(path, name))
    )


def signature(path: str) -> tuple:
    """What changes when the file or a file of the directory changes (followed through links)."""
    seen = []
    try:
        for name in files_of(path):
            stat = os.stat(name)
            seen.append((name, stat.st_ino, stat.st_mtime_ns, stat.st_size))
    except OSError as exc:
        return (("error", str(exc)),)
    return tuple(seen)


def load(path: str) -> dict[bytes, Key]:
    documents = []
    for name in files_of(path):
        try:
            with open(name, encoding="utf-8") as file:
                documents.append((name, yaml.load(file, Loader=YAML_LOADER)))
        except OSError as exc:
            raise KeyFileError(f"{name}: cannot read it: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            raise KeyFileError(f"{name}: not YAML ({type(exc).__name__})") from None
    return parse(documents)


class KeyRing:
    """The keys of a key file, read again when it changes (`check`) or when told (`reload`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.reloads = 0
        self.failures = 0
        self.seen = signature(path)
        self.keys = load(path)  # a file that does not load at start stops the start
        self.tenants = {key.tenant.name: key.tenant for key in self.keys.values()}

    def find(self, key: bytes) -> Key | None:
        """The key whose sha256 is that of `key`, compared in constant time; None if none."""
        hashed = hashlib.sha256(key).digest()
        found = self.keys.get(hashed)
        if found is None or not hmac.compare_digest(found.digest, hashed):
            return None
        return found

    def check(self) -> bool:
        """Read the file again if it changed; whether the keys changed."""
        return self.changed() and self.reload()

    def changed(self) -> bool:
        """Whether the file changed since it was last read (a stat of each file, no reading)."""
        seen = signature(self.path)
        if seen == self.seen:
            return False
        self.seen = seen
        return True

    def reload(self) -> bool:
        keys = self.read()
        return keys is not None and self.install(keys)

    async def reload_aside(self) -> bool:
        """reload() with the file read and parsed on a thread: 10,000 keys take most of a second,
        which the door's event loop, serving every client, must not spend."""
        keys = await asyncio.to_thread(self.read)
        return keys is not None and self.install(keys)

    def read(self) -> dict[bytes, Key] | None:
        """The file's keys, or None (told and counted) when it does not load, or (not counted: read
        again at the next check) when it changed while it was read, a write not yet finished."""
        before = signature(self.path)
        try:
            keys = load(self.path)
        except KeyFileError as exc:
            self.failures += 1
            logger.error("the API key file was not reloaded, the keys stay as they were: %s", exc)
            return None
        if signature(self.path) != before:
            self.seen = ("changing",)
            logger.info("the API key file changed while it was read: read again at the next check")
            return None
        return keys

    def install(self, keys: dict[bytes, Key]) -> bool:
        old = {key.id for key in self.keys.values()}
        # A tenant's limits and models change in place for requests to come; its state (buckets,
        # tickets) is kept by the admission stage, by the tenant's name.
        self.keys = keys
        self.tenants = {key.tenant.name: key.tenant for key in keys.values()}
        self.reloads += 1
        now = {key.id for key in keys.values()}
        logger.info(
            "API keys reloaded from %s: %d key(s) of %d tenant(s); added %s; removed %s",
            self.path,
            len(keys),
            len(self.tenants),
            ", ".join(sorted(now - old)) or "none",
            ", ".join(sorted(old - now)) or "none",
        )
        return True


def main(argv: list[str] | None = None) -> int:
    """`python -m front_door.keys new --tenant T --id ID`: a fresh key, and its entry for the key file."""
    parser = argparse.ArgumentParser(prog="python -m front_door.keys", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    new = sub.add_parser("new", help="make a key: prints the key (give it to the tenant) and the file's entry")
    new.add_argument("--tenant", required=True)
    new.add_argument("--id", required=True, help="the key's id, named in logs and metrics")
    hashed = sub.add_parser("hash", help="the sha256 of a key read from stdin")
    hashed.set_defaults(tenant=None)
    args = parser.parse_args(argv)
    if args.command == "hash":
        print(digest(sys.stdin.readline().strip()).hex())
        return 0
    key = new_key()
    print(f"key (give it to {args.tenant}; it is not stored): {key}", file=sys.stderr)
    print(yaml.safe_dump([{"id": args.id, "tenant": args.tenant, "sha256": digest(key).hex()}], sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
