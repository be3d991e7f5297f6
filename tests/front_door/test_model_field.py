"""The door reads a body's `model` as json.loads would, without building the body
(front_door/model_field.py): random JSON objects, the same answer; hostile bodies, bounded work."""

from __future__ import annotations

import json
import random
import time

import pytest

from front_door.model_field import NOT_A_STRING, NOT_NAMED, TooComplex, model_field, with_model


def expected(document: dict) -> object:
    value = document.get("model", NOT_NAMED)
    return NOT_A_STRING if isinstance(value, (list, dict)) else value


def random_value(rng: random.Random, depth: int = 0) -> object:
    roll = rng.random()
    if depth > 3 or roll < 0.3:
        return rng.choice(['s"}{[', 1, -2.5e3, None, True, "model", "x\\y", "\\\\", "é"])
    if roll < 0.6:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = ["model", "a", 'mo"del', "b", "\\model"]
    return {rng.choice(keys): random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def test_random_objects_read_as_json_loads_reads_them():
    rng = random.Random(61)
    for _ in range(5000):
        document = {"k": random_value(rng)}
        if rng.random() < 0.6:
            document["model"] = random_value(rng)
        text = json.dumps(document, indent=rng.choice([None, 1]), ensure_ascii=rng.random() < 0.5).encode()
        field = model_field(text)
        assert field.is_object and (field.value == expected(document) or field.value is expected(document)), text


@pytest.mark.parametrize(
    "body, value",
    [
        (b'{"mo\\u0064el": "z"}', "z"),
        (b'{"model": "a", "model": "b"}', "b"),
        (b'{"a": {"model": "x"}, "model": "y"}', "y"),
        (b'{"x": "}}}}\\"", "model" : "k" }', "k"),
        (b'{"model": null}', None),
    ],
)
def test_what_json_allows_is_read_as_json(body, value):
    assert model_field(body).value == value


def test_a_body_that_is_not_an_object_is_left_alone():
    assert not model_field(b"[1, 2]").is_object and not model_field(b"not json").is_object


def test_the_model_set_is_the_last_key_so_it_wins():
    assert json.loads(with_model(b'{"a": 1, "model": null}', "m")) == {"a": 1, "model": "m"}
    assert json.loads(with_model(b"{ }", "m")) == {"model": "m"}


def test_nesting_and_long_strings_cost_little_and_millions_of_strings_are_refused():
    began = time.monotonic()
    assert model_field(b'{"x": [' + b"[]," * 3_000_000 + b'[]], "model": "m"}').value == "m"
    assert model_field(b'{"x": "' + b"a" * 50_000_000 + b'", "model": "m"}').value == "m"
    assert time.monotonic() - began < 2
    with pytest.raises(TooComplex):
        model_field(b'{"x": [' + b'"",' * 300_000 + b'""], "model": "m"}')
    with pytest.raises(TooComplex):
        model_field(b'{"x": "' + b'\\"' * 300_000 + b'", "model": "m"}')
