"""A live motor-controller process for motorctl to talk to."""

from __future__ import annotations

import pytest

from tests.support.controller_process import AT_ONCE, ControllerProcess


@pytest.fixture
def controller(tmp_path):
    proc = ControllerProcess(tmp_path, *AT_ONCE)
    proc.start()
    yield proc
    proc.stop()
    proc.log.close()
