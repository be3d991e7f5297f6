"""motorctl pki: a development PKI (CA, certificates with Motor identities, bearer tokens).

    motorctl pki init   --dir DIR                        CA: DIR/ca.crt, DIR/ca.key
    motorctl pki issue  --dir DIR NAME [--identity ID] [--host H ...]
                                                         DIR/NAME.crt, DIR/NAME.key signed by the CA
    motorctl pki tokens --file FILE NAME=ROLE[+ROLE] ... a tokens file with fresh tokens
    motorctl pki door-keys --dir DIR                     the front door's development key (DIR/api-key,
                                                         its hash in DIR/api-keys.yaml) and the
                                                         engines' key (DIR/engine.key, 0400)
    motorctl pki dev    --dir DIR [--nodes node-a,node-b] [--host H ...]
                                                         everything a cluster needs (as `up --tls`)

ID is `controller`, `node/<node id>`, `operator/<name>` or `viewer/<name>` (docs/security.md).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass

from motor.errors import MotorError
from motor.security.identity import TRUST_DOMAIN, Identity
from motor.security.pki import CA_CERT, CA_KEY, CertificateAuthority, write_private
from motor.security.tokens import write_tokens_file
from motorctl.door_access import kept_engine_key, write_dev_keys

DEV_HOSTS = ["localhost", "127.0.0.1"]
TOKENS_FILE = "tokens.yaml"
MAX_DAYS = 36500  # 100 years; beyond, the dates overflow (X.509 ends at 9999) and nothing needs it
PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")  # a file name in --dir, never a path


def check_days(days: float) -> float:
    """--days: a certificate valid from now for a positive, finite, sane number of days."""
    if not (math.isfinite(days) and 0 < days <= MAX_DAYS):
        raise MotorError(
            f"--days: give a number of days above 0 and at most {MAX_DAYS} (got {days:g}); "
            "0 or less would issue a certificate already expired"
        )
    return days


def check_name(name: str) -> str:
    """NAME of `pki issue`: NAME.crt and NAME.key are written in --dir, so a plain file name."""
    if not PLAIN_NAME.fullmatch(name):
        raise MotorError(
            f"NAME: {name!r} is not a plain file name (letters, digits, '.', '_', '-', not starting "
            "with '.' or '-'): NAME.crt and NAME.key are written in --dir, never elsewhere"
        )
    return name


@dataclass(frozen=True)
class DevPki:
    """The files of a development PKI, by the names the services' flags take."""

    directory: str

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    @property
    def ca(self) -> str:
        return self.path(CA_CERT)

    def cert(self, name: str) -> str:
        return self.path(f"{name}.crt")

    def key(self, name: str) -> str:
        return self.path(f"{name}.key")

    def token_file(self, name: str) -> str:
        return self.path(f"{name}.token")

    @property
    def tokens(self) -> str:
        return self.path(TOKENS_FILE)


def make_dev_pki(directory: str, nodes: list[str], hosts: list[str] | None = None) -> DevPki:
    """A CA, then controller, one pair per node, operator, viewer and router-sync, and a tokens file.

    An existing CA in `directory` is kept (certificates are re-issued from it), so a client
    that trusts it keeps working across restarts of a development cluster.
    """
    hosts = hosts or DEV_HOSTS
    pki = DevPki(directory)
    if os.path.exists(pki.ca) and os.path.exists(pki.path(CA_KEY)):
        ca = CertificateAuthority.load(directory)
    else:
        ca = CertificateAuthority.create()
        ca.save(directory)
    ca.issue(Identity("controller"), hosts).save(directory, "controller")
    for node in nodes:
        ca.issue(Identity("node", node), hosts).save(directory, node)
    for kind in ("operator", "viewer", "router-sync"):
        ca.issue(Identity(kind, kind), []).save(directory, kind)
    tokens = write_tokens_file(pki.tokens, {"operator": ["operator"], "viewer": ["viewer"]})
    for name, token in tokens.items():
        write_private(pki.token_file(name), token.encode())
    return pki


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="motorctl pki", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    init = sub.add_parser("init", help="create a CA (ca.crt, ca.key) in --dir")
    init.add_argument("--dir", required=True, help="directory for the CA files")
    init.add_argument("--days", type=float, default=3650, help="validity in days [3650]")
    init.add_argument(
        "--force", action="store_true", help="replace an existing CA (every certificate it signed stops being trusted)"
    )
    issue = sub.add_parser("issue", help="issue NAME.crt/NAME.key signed by the CA in --dir")
    issue.add_argument("name", help="file name stem, e.g. node-a")
    issue.add_argument("--dir", required=True, help="directory holding ca.crt/ca.key; the pair is written there")
    issue.add_argument(
        "--identity",
        help="controller, node/<id>, operator/<name> or viewer/<name>; omit for a "
        "certificate that is no Motor identity (an etcd member's: --host only)",
    )
    issue.add_argument(
        "--host", action="append", default=[], help="DNS name or IP the server is reached at (repeatable)"
    )
    issue.add_argument("--days", type=float, default=365, help="validity in days [365]")
    issue.add_argument("--trust-domain", default=TRUST_DOMAIN, help=f"SPIFFE trust domain [{TRUST_DOMAIN}]")
    tokens = sub.add_parser("tokens", help="write a tokens file with a fresh token per NAME=ROLE[+ROLE]")
    tokens.add_argument("--file", required=True, help="tokens file to write (mode 0600)")
    tokens.add_argument("entries", nargs="+", metavar="NAME=ROLES", help="e.g. alice=operator bob=viewer")
    door = sub.add_parser(
        "door-keys",
        help="the front door's development key (api-key, its hash in api-keys.yaml) and the engines' "
        "key (engine.key, 0400) in --dir; existing ones are kept",
    )
    door.add_argument("--dir", required=True, help="directory to write")
    dev = sub.add_parser("dev", help="the whole development set: CA, controller, nodes, operator, viewer, tokens")
    dev.add_argument("--dir", required=True, help="directory to write (an existing CA there is reused)")
    dev.add_argument("--nodes", default="node-a,node-b", help="comma-separated node ids [node-a,node-b]")
    dev.add_argument(
        "--host", action="append", default=[], help=f"server names/IPs (repeatable) [{', '.join(DEV_HOSTS)}]"
    )
    return p


def run(args: argparse.Namespace, out=sys.stdout) -> int:
    if args.action == "init":
        if os.path.exists(os.path.join(args.dir, CA_CERT)) and not args.force:
            raise MotorError(f"--dir: {args.dir} already holds a CA; pass --force to replace it")
        cert, key = CertificateAuthority.create(days=check_days(args.days)).save(args.dir)
        print(f"CA written: {cert} (share it), {key} (keep it secret)", file=out)
    elif args.action == "issue":
        name, days = check_name(args.name), check_days(args.days)
        identity = Identity.parse(args.identity) if args.identity else None
        pair = CertificateAuthority.load(args.dir).issue(identity, args.host, days=days, trust_domain=args.trust_domain)
        cert, key = pair.save(args.dir, name)
        print(f"{identity.uri(args.trust_domain) if identity else ', '.join(args.host)}: {cert}, {key}", file=out)
    elif args.action == "tokens":
        roles = {}
        for entry in args.entries:
            name, _, wanted = entry.partition("=")
            roles[name] = wanted.split("+")
        write_tokens_file(args.file, roles)
        print(f"tokens written to {args.file} for {', '.join(roles)}", file=out)
    elif args.action == "door-keys":
        os.makedirs(args.dir, exist_ok=True)
        if not os.path.exists(os.path.join(args.dir, "api-keys.yaml")):
            write_dev_keys(args.dir)
        engine = os.path.join(args.dir, "engine.key")
        kept_engine_key(engine, mode=0o400)  # (MOTOR_ENGINE_API_KEY_FILE of the compose services)
        print(f"door keys in {args.dir}: api-key (the key), api-keys.yaml (its hash), {engine}", file=out)
    else:
        nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
        pki = make_dev_pki(args.dir, nodes, args.host or None)
        print(
            f"development PKI in {pki.directory}: ca.crt, controller, {', '.join(nodes)}, operator, viewer, "
            f"{TOKENS_FILE}",
            file=out,
        )
    return 0


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except MotorError as exc:
        print(f"motorctl pki: {exc}", file=sys.stderr)
        return 2
