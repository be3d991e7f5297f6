"""A full disk replayed at the store boundary: every write statement of the SQLite store fails with the
error SQLite gives on a full disk, until freed."""

from __future__ import annotations

import sqlite3

WRITES = ("INSERT", "DELETE", "BEGIN", "COMMIT")


def fill_disk(store) -> None:
    real = store.db

    class FullDisk:
        def __getattr__(self, name):
            return getattr(real, name)

        def execute(self, sql, args=()):
            if sql.lstrip().upper().startswith(WRITES):
                raise sqlite3.OperationalError("database or disk is full")
            return real.execute(sql, args)

    store.db = FullDisk()
    store.real_db = real


def free_disk(store) -> None:
    store.db = store.real_db
