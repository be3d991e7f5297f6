"""`motorctl pki door-keys`: the front door's development key and the engines' key, as compose's
`pki` service writes them into its volume."""

from __future__ import annotations

import os
import stat

from front_door.keys import KeyRing
from motor.engine_key import ENGINE_KEY_FILE_ENV, engine_key
from motorctl.pki_command import main


def test_door_keys_writes_a_key_the_key_file_takes_and_an_engine_key(tmp_path, monkeypatch, capsys):
    assert main(["door-keys", "--dir", str(tmp_path)]) == 0
    secret = (tmp_path / "api-key").read_text().strip()
    keys = KeyRing(str(tmp_path / "api-keys.yaml"))
    assert keys.find(secret.encode()) is not None and keys.find(secret.encode() + b"x") is None
    engine = tmp_path / "engine.key"
    assert stat.S_IMODE(os.stat(engine).st_mode) == 0o400
    assert stat.S_IMODE(os.stat(tmp_path / "api-key").st_mode) == 0o600
    monkeypatch.setenv(ENGINE_KEY_FILE_ENV, str(engine))
    monkeypatch.delenv("MOTOR_ENGINE_API_KEY", raising=False)
    first = engine_key()
    assert first and first.startswith("sk-motor-engine-")
    # Run again (compose's pki service on every `up`): the keys the running services hold are kept.
    assert main(["door-keys", "--dir", str(tmp_path)]) == 0
    assert engine_key() == first and (tmp_path / "api-key").read_text().strip() == secret
