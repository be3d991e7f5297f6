"""motor/engine_key.py: the engines' key from MOTOR_ENGINE_API_KEY, or from the file
MOTOR_ENGINE_API_KEY_FILE names (compose: a variable cannot come from a volume)."""

from __future__ import annotations

import os

import pytest

from motor.engine_key import ENGINE_KEY_ENV, ENGINE_KEY_FILE_ENV, EngineKeyError, engine_key


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)
    monkeypatch.delenv(ENGINE_KEY_FILE_ENV, raising=False)


def test_no_key_without_either_variable():
    assert engine_key() is None


def test_the_variable_itself(monkeypatch):
    monkeypatch.setenv(ENGINE_KEY_ENV, "sk-motor-engine-a")
    assert engine_key() == "sk-motor-engine-a"


def test_the_file_when_the_variable_is_unset(monkeypatch, tmp_path):
    held = tmp_path / "engine.key"
    held.write_text("sk-motor-engine-b\n")
    os.chmod(held, 0o400)
    monkeypatch.setenv(ENGINE_KEY_FILE_ENV, str(held))
    assert engine_key() == "sk-motor-engine-b"
    monkeypatch.setenv(ENGINE_KEY_ENV, "sk-motor-engine-a")  # the variable, when set, wins
    assert engine_key() == "sk-motor-engine-a"


def test_an_unreadable_file_is_an_error_naming_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(ENGINE_KEY_FILE_ENV, str(tmp_path / "missing.key"))
    with pytest.raises(EngineKeyError, match=ENGINE_KEY_FILE_ENV):
        engine_key()


@pytest.mark.parametrize("content", ["", "\n", "   \n", "\nsk-on-the-second-line\n"])
def test_an_empty_file_is_an_error_naming_the_variable(monkeypatch, tmp_path, content):
    held = tmp_path / "engine.key"
    held.write_text(content)
    monkeypatch.setenv(ENGINE_KEY_FILE_ENV, str(held))
    with pytest.raises(EngineKeyError, match=f"{ENGINE_KEY_FILE_ENV}.*holds no key"):
        engine_key()


def test_every_caller_takes_the_file_form(monkeypatch, tmp_path):
    """The engine server's admission and probes, the controller's adapter loads and the front door
    read the key through engine_key(): the file form reaches each of them."""
    from controller.routing import adapters
    from engine_server import probing
    from engine_server.engines import admission
    from front_door import router_pool

    for module in (adapters, probing, admission, router_pool):
        assert module.engine_key is engine_key, module.__name__
    held = tmp_path / "engine.key"
    held.write_text("sk-motor-engine-c\n")
    monkeypatch.setenv(ENGINE_KEY_FILE_ENV, str(held))
    assert admission.engine_key() == "sk-motor-engine-c"


def test_the_engine_servers_admission_demands_the_key_from_the_file(monkeypatch, tmp_path):
    from engine_server.engines.admission import Admission

    held = tmp_path / "engine.key"
    held.write_text("sk-motor-engine-d\n")
    monkeypatch.setenv(ENGINE_KEY_FILE_ENV, str(held))
    assert Admission().key == "sk-motor-engine-d"
    held.write_text("")
    with pytest.raises(EngineKeyError):  # an engine does not start open when its key file is empty
        Admission()
