"""Loading the engine server's user_config (models in motor/contract/user_config.py): the whole file is
validated at start-up, errors name the field, and the role's engine_args are checked by its
engine class."""

from __future__ import annotations

import logging
import os

from motor.contract.user_config import EngineSection, UserConfig
from motor.errors import ConfigError
from motor.service import config as motor_config

logger = logging.getLogger(__name__)


# What every engine (and its children) sees unless its section sets usage_stats: true.
NO_USAGE_STATS = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def apply_usage_stats(section: EngineSection, environ=os.environ) -> None:
    """Turn the engine's usage statistics off, unless the section asks for them."""
    if not section.usage_stats:
        environ.update(NO_USAGE_STATS)


def load_section(path: str, role: str, defer_slow_checks: bool = False) -> tuple[str, EngineSection]:
    """Load and validate the whole file, then return (section name, section) for `role`.

    Raises ConfigError naming the field; engine_args are checked by the engine class, except a
    slow check (EngineBackend.slow_check_args) with defer_slow_checks: the engine server runs
    that one once its management plane answers."""
    from engine_server.engines import engine_class  # the engines import the config models

    data = motor_config.read_document(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the user_config must be a JSON object with motor_engine_*_config sections")
    config = motor_config.validate(UserConfig, data, source=path)
    if config.ignored_sections:
        logger.info("%s: ignoring the sections of other components: %s", path, ", ".join(config.ignored_sections))
    for name in config.present():
        getattr(config, name).mgmt_tls_config.check_files(f"{name}.mgmt_tls_config")
    name, section = config.section_for(role)
    if section is None:
        hint = " (or motor_engine_prefill_config, which union falls back to)" if role == "union" else ""
        raise ConfigError(f"{path}: {name}: missing; the {role} role needs this section{hint}")
    for warning in section.health_check_config.warnings(f"{name}.health_check_config"):
        logger.warning("%s: %s", path, warning)
    engine = engine_class(section.engine_type)
    if not (defer_slow_checks and engine.slow_check_args):
        section.engine_args = engine.check_args(section.engine_args, f"{name}.engine_args")
    return name, section
