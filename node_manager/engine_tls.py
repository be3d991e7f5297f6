"""The TLS files a node manager hands its engines: a copy of the ones it is using.

Engines serve with their node's certificate. Handed the node's own paths, every engine started
while one of those files is bad (garbage, deleted, a symlink loop, expired, a rotation caught half
way) would exit at once naming the file, spend its restart budget and leave its instance FAILED,
while the node manager itself keeps its last good files (motor/service/tls.py) and looks healthy. So the
engines get a copy in the state directory, written from the node manager's own `TlsFileWatch`:
only files it accepted reach it, a good rotation reaches it within a second (running engines
follow their files, so they rotate too), and a bad one never does.

The copy is a directory per version and a `current` symlink swapped atomically, so an engine
reading its three files never sees a new certificate beside an old key.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import uuid

from motor.security.pki import write_atomically
from motor.service.tls import TlsFileWatch

logger = logging.getLogger(__name__)

FOLLOW_SECONDS = 1.0  # how often the node's files are looked at (a stat each) for a rotation
NAMES = {"cert": "node.crt", "key": "node.key", "ca": "ca.crt"}


def engine_tls_dir(state_dir: str) -> str:
    return os.path.join(os.path.abspath(state_dir), "engine-tls")


def engine_tls_paths(state_dir: str) -> dict[str, str]:
    """cert, key, ca -> the paths engines are given (through the `current` symlink)."""
    current = os.path.join(engine_tls_dir(state_dir), "current")
    return {field: os.path.join(current, name) for field, name in NAMES.items()}


class EngineTlsCopy:
    def __init__(self, state_dir: str, cert: str, key: str, ca: str):
        """The watch is the process's shared one of these files (its client channels use it), so
        the copy holds exactly what the node manager presents; a bad file at start is a
        ConfigError naming it (exit 2), as for the node manager itself."""
        self.watch = TlsFileWatch.shared(cert, key, ca)
        self.directory = engine_tls_dir(state_dir)
        self._written = -1  # the watch's `reloads` the copy holds

    def refresh(self) -> bool:
        """Bring the copy to the files the node manager uses now; True when it was rewritten."""
        self.watch.changed()
        current = os.path.join(self.directory, "current")
        if self._written == self.watch.reloads and os.path.isdir(current):
            return False
        version = f"v{self.watch.reloads}-{uuid.uuid4().hex[:8]}"
        os.makedirs(os.path.join(self.directory, version), mode=0o700)
        pems = self.watch.pems
        for field, name in NAMES.items():
            write_atomically(os.path.join(self.directory, version, name), getattr(pems, field), private=field == "key")
        link = os.path.join(self.directory, f".{version}.link")
        os.symlink(version, link)
        previous = os.readlink(current) if os.path.islink(current) else None
        os.replace(link, current)
        for old in os.listdir(self.directory):  # the version just replaced may still be read by an engine
            if old not in (version, previous, "current"):
                shutil.rmtree(os.path.join(self.directory, old), ignore_errors=True)
        if self._written >= 0:
            logger.info("engines' TLS files (%s) updated from this node manager's rotated ones", self.directory)
        self._written = self.watch.reloads
        return True

    async def follow(self) -> None:
        while True:
            await asyncio.sleep(FOLLOW_SECONDS)
            try:
                self.refresh()
            except OSError as exc:  # a full disk: engines keep the previous copy; said, tried again
                logger.error("cannot update the engines' TLS files in %s: %s", self.directory, exc)
