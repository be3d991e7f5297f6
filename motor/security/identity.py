"""Who a caller is: a SPIFFE-style URI in its certificate's subjectAltName.

    spiffe://motor/controller           the controller
    spiffe://motor/node/node-a          the node manager of node-a (also its engines' manager)
    spiffe://motor/operator/alice       an operator (may apply and delete deployments, and read)
    spiffe://motor/viewer/bob           a viewer (may read)

The URI SAN, not the CN, is the identity: a CN is free text that many CAs fill in for display,
while a URI SAN is what SPIFFE/SPIRE, cert-manager and most internal CAs can issue exactly.
`motor` is the default trust domain; a site with its own PKI may choose another one
(`--trust-domain`), and certificates from any other trust domain carry no identity.
"""

from __future__ import annotations

from dataclasses import dataclass

from motor.contract.names import ID_RULE, is_valid_id
from motor.errors import InvalidArgument

TRUST_DOMAIN = "motor"
# kind -> whether it carries a name (node id, operator or viewer name)
KINDS = {"controller": False, "node": True, "operator": True, "viewer": True}


@dataclass(frozen=True)
class Identity:
    kind: str
    name: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"identity kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if KINDS[self.kind] and not is_valid_id(self.name):
            raise InvalidArgument(f"identity {self.kind}/{self.name!r}: the name {ID_RULE}")
        if not KINDS[self.kind] and self.name:
            raise InvalidArgument(f"identity {self.kind!r} takes no name (got {self.name!r})")

    @classmethod
    def parse(cls, text: str) -> Identity:
        """'controller', 'node/node-a', 'operator/alice', 'viewer/bob'."""
        kind, _, name = text.partition("/")
        return cls(kind, name)

    def path(self) -> str:
        return f"{self.kind}/{self.name}" if self.name else self.kind

    def uri(self, trust_domain: str = TRUST_DOMAIN) -> str:
        return f"spiffe://{trust_domain}/{self.path()}"

    def __str__(self) -> str:
        return self.uri()


def identity_from_uri(uri: str, trust_domain: str = TRUST_DOMAIN) -> Identity | None:
    """The identity a URI SAN names, or None when it is not a Motor identity of `trust_domain`."""
    prefix = f"spiffe://{trust_domain}/"
    if not uri.startswith(prefix):
        return None
    try:
        return Identity.parse(uri[len(prefix) :])
    except InvalidArgument:
        return None
