"""A deployment file says each thing once and numbers as numbers: a key written twice took its
last value silently, and `target_in_flight: "1"` (a string) was accepted where `count: '3'` was
refused. Both are refused now, naming the key or the field."""

from __future__ import annotations

import pytest

from motor.contract.deployment_file import load_deployment
from motor.errors import ConfigError, InvalidArgument

HEAD = """name: d
model: sim-tiny
engine_config:
  motor_engine_union_config: {engine_type: sim}
"""


def write(tmp_path, text: str, name: str = "d.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (HEAD + "model: sim-other\ninstance_groups: [{name: u, role: union}]\n", "'model'"),
        (HEAD + "instance_groups:\n- name: u\n  role: union\n  count: 2\n  count: 5\n", "'count'"),
    ],
)
def test_a_key_written_twice_is_refused_naming_it_and_its_line(tmp_path, text, key):
    with pytest.raises(ConfigError) as refused:
        load_deployment(write(tmp_path, text))
    assert f"duplicate key {key}" in str(refused.value) and "line" in str(refused.value)


def test_a_key_written_twice_in_json_is_refused_naming_it(tmp_path):
    text = '{"name": "d", "name": "e", "model": "sim-tiny", "instance_groups": []}'
    with pytest.raises(ConfigError) as refused:
        load_deployment(write(tmp_path, text, "d.json"))
    assert "duplicate key 'name'" in str(refused.value)


def test_yaml_merge_keys_still_override_what_they_merge(tmp_path):
    text = HEAD + "instance_groups:\n- <<: {name: u, role: union, count: 1}\n  count: 2\n"
    assert load_deployment(write(tmp_path, text)).instance_groups[0].count == 2


@pytest.mark.parametrize(("value", "field"), [("'3'", "count"), ('"1"', "autoscaling.target_in_flight")])
def test_a_quoted_number_is_refused_naming_the_field(tmp_path, value, field):
    block = "count: 1\n    autoscaling: {max: 4, target_in_flight: 4}" if field != "count" else "count: " + value
    if field != "count":
        block = "count: 1\n    autoscaling: {max: 4, target_in_flight: " + value + "}"
    text = HEAD + "instance_groups:\n  - name: u\n    role: union\n    " + block + "\n"
    with pytest.raises(InvalidArgument) as refused:
        load_deployment(write(tmp_path, text))
    assert f"instance_groups[0].{field}: expected a" in str(refused.value)


def test_a_number_in_exponent_form_is_a_number(tmp_path):
    text = HEAD + "instance_groups:\n  - name: u\n    role: union\n    autoscaling: {max: 4, target_in_flight: 1e3}\n"
    assert load_deployment(write(tmp_path, text)).instance_groups[0].autoscaling.target_in_flight == 1000.0
