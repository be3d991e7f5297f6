"""A StartEngine spec whose texts end up on the engine's command line: a NUL byte (exec refuses
it: the call answered UNKNOWN) or another control character is INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import pytest

from motor.errors import InvalidArgument
from motor.v1 import types_pb2 as T
from node_manager.config import NodeManagerConfig
from node_manager.specs import check_spec


@pytest.mark.parametrize("field", ["host", "master_dp_ip"])
def test_a_control_character_in_a_spec_text_names_the_field(tmp_path, field):
    spec = T.EngineSpec(instance_id="u-0", role=T.ROLE_UNION, config_json="{}")
    setattr(spec, field, "10.0.0.1\x00; rm -rf /")
    with pytest.raises(InvalidArgument, match=rf"spec\.{field} .* holds the control character '\\x00'"):
        check_spec(spec, NodeManagerConfig(node_id="node-a", state_dir=str(tmp_path)))
