"""TLS at the front door: a server context from certificate and key files, followed when they change.

The listening server keeps one `ssl.SSLContext` for its life; each handshake is moved onto the
latest context built from the files (its SNI callback, which OpenSSL calls for every ClientHello,
with or without a server name), so a renewed certificate is served from the next connection on
and no connection is dropped. Files that do not load (a half-written renewal) leave the last good
context in place (logged). With `client_ca`, clients must present a certificate it signed.
"""

from __future__ import annotations

import logging
import os
import ssl

logger = logging.getLogger(__name__)


def server_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["http/1.1"])
    if client_ca:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class DoorTls:
    def __init__(self, cert: str, key: str, client_ca: str | None = None) -> None:
        self.files = tuple(path for path in (cert, key, client_ca) if path)
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self.current = server_context(cert, key, client_ca)  # files that do not load stop the start
        self.seen = self._signature()
        self.reloads = 0
        self.failures = 0
        self.context = server_context(cert, key, client_ca)  # the server's: it hands each handshake on
        self.context.sni_callback = self._handshake

    def _handshake(self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        if self.current is not context:
            connection.context = self.current
        return None

    def _signature(self) -> tuple:
        try:
            stats = [os.stat(path) for path in self.files]
        except OSError:
            return ()
        return tuple((stat.st_mtime_ns, stat.st_size, stat.st_ino) for stat in stats)

    def check(self) -> bool:
        """Build a new context if the files changed; whether one was built."""
        seen = self._signature()
        if seen == self.seen or not seen:
            return False
        try:
            context = server_context(self.cert, self.key, self.client_ca)
        except (OSError, ssl.SSLError) as exc:
            self.failures += 1
            logger.error("the front door's certificate was not reloaded (the last one is served): %s", exc)
            return False  # (tried again at the next check: a key written before its certificate)
        self.seen = seen
        self.current = context
        self.reloads += 1
        logger.info("the front door's certificate was reloaded from %s", self.cert)
        return True
