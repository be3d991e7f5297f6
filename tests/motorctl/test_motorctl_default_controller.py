"""Without --controller or MOTOR_CONTROLLER, motorctl run from a directory whose `.run` holds a
`motorctl up` cluster reaches that cluster (its motorctl.env), not localhost:50051."""

from __future__ import annotations

import os

from motorctl.cli import main as motorctl


def test_motorctl_reaches_the_cluster_of_the_run_dir_here(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MOTOR_CONTROLLER", raising=False)
    os.makedirs(tmp_path / ".run")
    (tmp_path / ".run" / "motorctl.env").write_text("export MOTOR_CONTROLLER=127.0.0.1:9\n")
    monkeypatch.chdir(tmp_path)
    assert motorctl(["--timeout", "1", "nodes"]) == 1
    err = capsys.readouterr().err
    assert "127.0.0.1:9" in err and "localhost:50051" not in err, err
