"""Who may call what: one table of methods and roles, and the checks that enforce it on every call.

Roles (docs/security.md has the same table for readers):
- `node:<id>`     a node manager, from a certificate with `spiffe://motor/node/<id>`; may register,
                  heartbeat and report events for node <id> only (Kubernetes' NodeRestriction);
- `node-manager`  on an engine server: the node manager of the engine's own node (`local_node`);
                  the only caller of Drain, Sleep and WakeUp;
- `controller`    the only caller of the node managers' StartEngine and StopEngine;
- `operator`      applies and deletes deployments, and reads everything a viewer reads;
- `viewer`        List/Get/Watch;
- `router-sync`   a router's motor-router-sync: ListEndpoints and WatchEndpoints (engine URLs
                  come from the controller, and the sync can learn nothing else), and
                  ReportFrontDoor (which of them its router holds).
Health checks are open to anyone; reflection (when the server offers it) too, as it only
describes the public API. A method missing from the table is refused: new RPCs must be added.

A secure server takes the identity from the verified client certificate (motor/security/identity.py) or,
without one, from a bearer token (motor/security/tokens.py). A plaintext server (loopback only, a
developer's cluster) has no identities: every caller holds every role, as before.
Each caller may hold at most `max_streams_per_caller` streams open at once.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import grpc
from cryptography import x509

from motor.contract.names import excerpt, is_valid_id
from motor.errors import status_message
from motor.security.identity import KINDS, TRUST_DOMAIN, Identity, identity_from_uri
from motor.security.tokens import TokenStore

logger = logging.getLogger(__name__)

OPEN = "anyone"
NODE = "node"  # stands for node:<id> where <id> is the node the request names


@dataclass(frozen=True)
class Rule:
    roles: frozenset[str]
    # Request fields that must name the caller's own node when the caller holds a node role.
    node_fields: tuple[str, ...] = ()


def _rule(*roles: str, node_fields: tuple[str, ...] = ()) -> Rule:
    return Rule(frozenset(roles), node_fields)


_C, _N, _E = "/motor.v1.ControllerService/", "/motor.v1.NodeManagerService/", "/motor.v1.EngineService/"
_READ = _rule("viewer", "operator")
_ENDPOINTS = _rule("viewer", "operator", "router-sync")

ACCESS_TABLE: dict[str, Rule] = {
    _C + "RegisterNode": _rule(NODE, node_fields=("node.node_id",)),
    _C + "Heartbeat": _rule(NODE, node_fields=("node_id",)),
    _C + "StreamHeartbeats": _rule(NODE, node_fields=("heartbeat.node_id",)),  # checked on every message
    _C + "ReportEngineEvent": _rule(NODE, node_fields=("node_id",)),
    _C + "ApplyDeployment": _rule("operator"),
    _C + "DeleteDeployment": _rule("operator"),
    _C + "PauseRollout": _rule("operator"),
    _C + "ResumeRollout": _rule("operator"),
    _C + "UndoRollout": _rule("operator"),
    _C + "GetDeployment": _READ,
    _C + "ListDeployments": _READ,
    _C + "ListNodes": _READ,
    _C + "ListInstances": _READ,
    _C + "ListEndpoints": _ENDPOINTS,
    _C + "WatchEvents": _READ,
    _C + "WatchEndpoints": _ENDPOINTS,
    _C + "ListControllers": _READ,
    _C + "ReportFrontDoor": _rule("router-sync"),
    _N + "StartEngine": _rule("controller"),
    _N + "StopEngine": _rule("controller"),
    _N + "GetEngine": _rule("controller", "viewer", "operator"),
    _N + "ListEngines": _rule("controller", "viewer", "operator"),
    _N + "WatchEngines": _rule("controller", "viewer", "operator"),
    _E + "Drain": _rule("node-manager"),
    _E + "Sleep": _rule("node-manager"),
    _E + "WakeUp": _rule("node-manager"),
    _E + "GetStatus": _rule("node-manager", "viewer", "operator"),
    _E + "WatchProbes": _rule("node-manager", "viewer", "operator"),
    "/grpc.health.v1.Health/Check": _rule(OPEN),
    "/grpc.health.v1.Health/Watch": _rule(OPEN),
    "/grpc.health.v1.Health/List": _rule(OPEN),
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": _rule(OPEN),
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": _rule(OPEN),
}


@dataclass(frozen=True)
class Caller:
    """An authenticated caller: how it is shown, the roles it holds, its node when it is one."""

    name: str
    roles: frozenset[str]
    node: str | None = None
    every_role: bool = False  # plaintext mode

    def describe(self) -> str:
        return f"{self.name} (roles: {', '.join(sorted(self.roles)) or 'none'})"


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def roles_of(identity: Identity, local_node: str | None) -> frozenset[str]:
    if identity.kind == "node":
        extra = {"node-manager"} if identity.name == local_node else set()
        return frozenset({f"node:{identity.name}", *extra})
    if identity.kind == "operator":
        return frozenset({"operator", "viewer"})
    return frozenset({identity.kind})


@functools.lru_cache(maxsize=1024)
def certificate_identities(pem: bytes, trust_domain: str) -> tuple[tuple[Identity, ...], str]:
    """Motor identities in a certificate's URI SANs, and a short description for refusals."""
    cert = x509.load_pem_x509_certificate(pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    found = tuple(i for i in (identity_from_uri(uri, trust_domain) for uri in uris) if i is not None)
    return found, f"certificate {cert.subject.rfc4514_string()} with URI SANs {uris or 'none'}"


def _field(request: Any, path: str) -> str:
    value = request
    for part in path.split("."):
        value = getattr(value, part)
    return value


def bearer_token(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = str(value).partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


@dataclass
class AccessPolicy:
    """What the interceptor enforces on one server."""

    secure: bool  # False: plaintext, every caller has every role
    tokens: TokenStore | None = None
    trust_domain: str = TRUST_DOMAIN
    local_node: str | None = None  # on an engine server: whose node manager may drain/sleep/wake it
    max_streams_per_caller: int = 100
    table: dict[str, Rule] = field(default_factory=lambda: ACCESS_TABLE)

    def authenticate(self, auth_context: dict[str, list[bytes]], metadata: Any, peer: str) -> Caller:
        if not self.secure:
            return Caller(f"plaintext caller {peer}", frozenset(), every_role=True)
        pems = auth_context.get("x509_pem_cert")
        if pems:
            identities, described = certificate_identities(pems[0], self.trust_domain)
            if len(identities) != 1:
                raise Refused(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"{described}: needs exactly one spiffe://{self.trust_domain}/<kind>[/<name>] identity "
                    f"(kinds: {', '.join(KINDS)})",
                )
            identity = identities[0]
            node = identity.name if identity.kind == "node" else None
            return Caller(identity.uri(self.trust_domain), roles_of(identity, self.local_node), node)
        token = bearer_token(metadata)
        if token is None:
            raise Refused(
                grpc.StatusCode.UNAUTHENTICATED, "no client certificate and no 'authorization: Bearer <token>' header"
            )
        entry = self.tokens.lookup(token) if (self.tokens is not None and token) else None
        if entry is None:
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, "the bearer token is not in this server's tokens file")
        return Caller(f"token:{entry.name}", frozenset(entry.roles))

    def authorize(self, method: str, caller: Caller, request: Any) -> None:
        rule = self.table.get(method)
        if rule is None:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"{method} is not in the access table: nobody may call it")
        if OPEN in rule.roles or caller.every_role:
            return
        if caller.roles & rule.roles:
            return
        needed = sorted(rule.roles - {NODE})
        if NODE in rule.roles:
            named = [(path, _field(request, path)) for path in rule.node_fields] if request is not None else []
            if caller.node is not None and all(value == caller.node for _, value in named):
                return
            wanted = {value for _, value in named}
            needed.append(f"node:{_quoted(wanted.pop())}" if len(wanted) == 1 else "node:<the node the request names>")
            if caller.node is not None:
                fields = ", ".join(f"{path}={excerpt(value)}" for path, value in named)
                raise Refused(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{caller.describe()} may not call {method} with {fields}: a node may act only for itself (needs "
                    f"role {' or '.join(needed)})",
                )
        raise Refused(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{caller.describe()} may not call {method}: needs role {' or '.join(needed)}",
        )

    def stream_key(self, caller: Caller | None, peer: str) -> str:
        """Streams are counted per identity; a plaintext or unauthenticated caller per host."""
        if caller is not None and not caller.every_role:
            return caller.name
        host = peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer
        return f"host {host}"


class AccessControl:
    """Authenticates, authorizes and counts streams for every call, per an `AccessPolicy`; the
    server's interceptor (motor/service/server_calls.py) asks it at each step of a call."""

    def __init__(self, policy: AccessPolicy):
        self.policy = policy
        self.open_streams: dict[str, int] = {}

    async def admit(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> Caller | None:
        """The caller, after checking it may call `method` (with `request`, when the call has
        one: a request stream's messages are checked as they come, `check_message`); aborts the
        call otherwise. None for a method open to anyone."""
        caller = None
        try:
            rule = self.policy.table.get(method)
            if rule is not None and OPEN in rule.roles:
                return None
            caller = self.policy.authenticate(context.auth_context(), context.invocation_metadata(), context.peer())
            self.policy.authorize(method, caller, request)
        except Refused as refusal:
            logger.warning("refused %s from %s: %s", method, context.peer(), refusal)
            await context.abort(refusal.code, status_message(refusal))
        return caller

    async def check_message(self, method: str, caller: Caller, request: Any, context: grpc.aio.ServicerContext) -> None:
        """One message of a request stream, checked as a unary request would be (a node's
        heartbeat stream may carry only its own node's heartbeats); aborts the call otherwise."""
        try:
            self.policy.authorize(method, caller, request)
        except Refused as refusal:
            logger.warning("refused %s from %s: %s", method, context.peer(), refusal)
            await context.abort(refusal.code, status_message(refusal))

    async def enter_stream(self, caller: Caller | None, context: grpc.aio.ServicerContext) -> str:
        """Counts a stream against its caller's limit (aborts the call over it); the key to leave with."""
        key = self.policy.stream_key(caller, context.peer())
        held = self.open_streams.get(key, 0)
        if held >= self.policy.max_streams_per_caller:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{key} already holds {held} open streams (limit max_streams_per_caller="
                f"{self.policy.max_streams_per_caller}): close one first",
            )
        self.open_streams[key] = held + 1
        return key

    def leave_stream(self, key: str | None) -> None:
        if key is None:
            return
        self.open_streams[key] -= 1
        if not self.open_streams[key]:
            del self.open_streams[key]


def _quoted(node_id: object) -> str:
    """A node id from a request, as a refusal names it: plain when it is a valid id, else an
    excerpt (escaped, cut: no raw newline or megabyte in a message)."""
    return node_id if is_valid_id(node_id) else excerpt(node_id)
