"""A corrupt, truncated or unreadable database stops the controller with one line naming the
file and what to do (exit 2), not a traceback; --discard-unreadable-db moves it aside and starts empty."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT

pytestmark = pytest.mark.processes


def controller(db, *flags: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "controller.cli", "--listen", "127.0.0.1:0", "--db", str(db), *flags],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=timeout,
    )


def stored_db(path) -> None:
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value BLOB);"
        + "".join(f"INSERT INTO meta VALUES ('k{i}', randomblob(4000));" for i in range(50))
    )
    db.close()


def corrupt(path) -> None:
    stored_db(path)
    with open(path, "r+b") as handle:
        handle.seek(4096)
        handle.write(b"\xff" * 8192)


def truncated(path) -> None:
    stored_db(path)
    with open(path, "r+b") as handle:
        handle.truncate(5000)


def garbage(path) -> None:
    path.write_bytes(b"this is not a database at all" * 100)


@pytest.mark.parametrize("damage", [corrupt, truncated, garbage])
def test_a_damaged_database_stops_the_controller_with_one_line(tmp_path, damage):
    db = tmp_path / "controller.db"
    damage(db)
    result = controller(db)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert str(db) in lines[0] and "restore it from a backup" in lines[0] and "--discard-unreadable-db" in lines[0]


@pytest.mark.parametrize(
    "shape, culprit, says",
    [
        ("db_dir", "controller.db", "must be a regular file"),
        ("wal_dir", "controller.db-wal", "must be a regular file"),  # the database itself is fine: keep it
        ("parent_is_file", "f", "cannot create the directory"),
    ],
)
def test_a_database_path_of_the_wrong_shape_is_one_line_naming_it(tmp_path, shape, culprit, says):
    db = tmp_path / "controller.db"
    if shape == "db_dir":
        db.mkdir()
    elif shape == "wal_dir":
        stored_db(db)
        (tmp_path / "controller.db-wal").mkdir()
    else:
        (tmp_path / "f").write_text("")
        db = tmp_path / "f" / "controller.db"
    result = controller(db)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert culprit in lines[0] and says in lines[0] and lines[0].count("db: ") >= 1, lines[0]
    assert "--discard-unreadable-db" not in lines[0]  # that advice would throw a good database away


def test_discard_unreadable_db_moves_it_aside_and_starts_empty(tmp_path):
    db = tmp_path / "controller.db"
    garbage(db)
    process = subprocess.Popen(
        [sys.executable, "-m", "controller.cli", "--listen", "127.0.0.1:0", "--db", str(db), "--discard-unreadable-db"],
        env=dict(os.environ, PYTHONPATH=REPO_ROOT),
        cwd=REPO_ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in process.stderr:
            if "controller serving on port" in line:
                break
    finally:
        process.terminate()
        process.wait(timeout=30)
    aside = [p.name for p in tmp_path.iterdir() if p.name.startswith("controller.db.unreadable-")]
    assert len(aside) == 1 and (tmp_path / aside[0]).read_bytes().startswith(b"this is not a database")
    assert sqlite3.connect(db).execute("SELECT count(*) FROM meta").fetchone() is not None
