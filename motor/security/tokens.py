"""Bearer tokens for operators and viewers: a YAML file of named tokens with roles.

    tokens:
      - name: alice            # shown in logs and refusals as token:alice
        roles: [operator]      # operator (apply, delete, read) or viewer (read)
        token: 9f2c...         # at least 16 characters; `motorctl pki tokens` makes good ones

A caller sends `authorization: Bearer <token>` (grpcurl: -H "authorization: Bearer ..."). A token
is compared with every entry in constant time (hmac.compare_digest on SHA-256 digests, no early
exit), so timing tells nothing about which token or how much of it matched. The file is re-read
when it changes on disk; an unreadable new version is logged and the previous one kept.
Tokens carry only operator and viewer roles: machines (controller, node managers) use certificates.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from typing import Literal

import yaml
from pydantic import BaseModel, Field, field_validator

from motor.contract.names import IdSetting
from motor.errors import ConfigError
from motor.security.pki import write_atomically
from motor.service.config import load, validate

logger = logging.getLogger(__name__)

TOKEN_ROLES = ("operator", "viewer")


class TokenEntry(BaseModel):
    name: IdSetting
    roles: list[Literal["operator", "viewer"]] = Field(min_length=1)
    token: str = Field(min_length=16)

    @field_validator("token")
    @classmethod
    def _token(cls, value: str) -> str:
        if not value.isprintable() or " " in value:
            raise ValueError("must be printable with no spaces (it travels in an HTTP/2 header)")
        return value


class TokensFile(BaseModel):
    tokens: list[TokenEntry] = Field(default_factory=list)

    @field_validator("tokens")
    @classmethod
    def _unique(cls, entries: list[TokenEntry]) -> list[TokenEntry]:
        names = [entry.name for entry in entries]
        doubled = sorted({name for name in names if names.count(name) > 1})
        if doubled:
            raise ValueError(f"names must be unique ({', '.join(doubled)} appear twice)")
        # One token under two names would silently carry the roles of whichever entry matched
        # last (a viewer's token pasted into an operator entry makes it an operator token).
        first_named: dict[str, str] = {}
        for entry in entries:
            if entry.token in first_named:
                raise ValueError(
                    f"tokens must be unique: {first_named[entry.token]} and {entry.name} have the same "
                    "token; give each entry its own (`motorctl pki tokens` makes them)"
                )
            first_named[entry.token] = entry.name
        return entries


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenStore:
    """The tokens of one file, re-read when the file changes."""

    def __init__(self, path: str):
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._entries: list[tuple[bytes, TokenEntry]] = []
        self._reload(strict=True)

    def _file_stamp(self) -> tuple[int, int, int]:
        stat = os.stat(self.path)
        return stat.st_mtime_ns, stat.st_size, stat.st_ino

    def _reload(self, strict: bool) -> None:
        try:
            stamp = self._file_stamp()
            if stamp == self._stamp:
                return
            parsed = load(TokensFile, self.path, prefix="tokens file")
        except (OSError, ConfigError) as exc:
            if strict:
                raise ConfigError(f"--tokens-file: {exc}") from None
            logger.warning("tokens file %s could not be re-read, keeping the previous tokens: %s", self.path, exc)
            return
        self._entries = [(_digest(entry.token), entry) for entry in parsed.tokens]
        if self._stamp is not None:
            logger.info("tokens file %s re-read: %d tokens", self.path, len(self._entries))
        self._stamp = stamp

    def lookup(self, token: str) -> TokenEntry | None:
        """The entry whose token equals `token`, comparing against every entry in constant time."""
        self._reload(strict=False)
        presented = _digest(token)
        found = None
        for digest, entry in self._entries:
            if hmac.compare_digest(digest, presented):
                found = entry
        return found


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_tokens_file(path: str, roles_by_name: dict[str, list[str]]) -> dict[str, str]:
    """Write a tokens file (mode 0600) with a fresh token per name; returns name -> token."""
    tokens = {name: new_token() for name in roles_by_name}
    entries = [{"name": name, "roles": roles, "token": tokens[name]} for name, roles in roles_by_name.items()]
    body = validate(TokensFile, {"tokens": entries}, source=path)
    header = '# Bearer tokens (docs/security.md): grpcurl -H "authorization: Bearer <token>"\n'
    write_atomically(path, (header + yaml.safe_dump(body.model_dump(), sort_keys=False)).encode(), private=True)
    return tokens
