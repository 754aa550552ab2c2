"""guided.grammar.json_schema.objects: propertyNames and min/maxProperties rewrites."""
from __future__ import annotations

import pytest

from guided.grammar.json_schema import sanitize_json_schema
from helpers.json_schema import rewritten_valid, valid

OBJECTS = [{}, {"a": 1}, {"b": 1}, {"c": 1}, {"a": 1, "b": 2}, {"a": 1, "c": 2},
           {"a": 1, "b": 2, "c": 3}, {"bb": 1}, {"z": 0}]
PROPS = {"a": {}, "b": {}, "c": {}}

CASES = [
    ({"type": "object", "properties": PROPS, "additionalProperties": False, "minProperties": 2}, True),
    ({"type": "object", "properties": PROPS, "additionalProperties": False, "maxProperties": 1}, True),
    ({"type": "object", "properties": PROPS, "required": ["a"], "additionalProperties": False,
      "maxProperties": 2}, True),
    ({"type": "object", "properties": PROPS, "maxProperties": 1}, False),
    ({"type": "object", "propertyNames": {"enum": ["a", "b"]}}, True),
    ({"type": "object", "propertyNames": {"const": "c"}}, True),
    ({"type": "object", "properties": {"a": {}, "bb": {}}, "additionalProperties": False,
      "propertyNames": {"maxLength": 1}}, True),
]


@pytest.mark.parametrize("schema,exact", CASES)
def test_object_rewrites(schema, exact):
    out, _ = sanitize_json_schema(schema)
    for x in OBJECTS:
        got, want = rewritten_valid(out, x), valid(schema, x)
        if got:
            assert want, (out, x)
        elif exact:
            assert not want, (out, x)


def test_literal_pattern_properties_become_listed_properties():
    schema = {"type": "object", "patternProperties": {r"^\w+$": {"type": "object"},
                                                      "^(links|meta)$": {"required": ["x"]}}}
    out, _ = sanitize_json_schema(schema)
    assert "^(links|meta)$" not in str(out)
    for x in [{"links": {"x": 1}}, {"links": {}}, {"links": 1}, {"meta": {"x": 0}, "k": {}},
              {"k": 1}, {"links-x": {}}]:
        assert rewritten_valid(out, x) == valid(schema, x), x


def test_one_property_dependency_splits_into_two_plain_objects():
    schema = {"$schema": "http://json-schema.org/draft-07/schema#",
              "type": "object", "properties": {"a": {"type": "integer"}, "b": {}, "c": {}},
              "required": ["a"], "dependencies": {"b": ["c"]}}
    out, _ = sanitize_json_schema(schema)
    assert "allOf" not in str(out)
    for x in [{"a": 1}, {"a": 1, "b": 0}, {"a": 1, "b": 0, "c": 0}, {"b": 0, "c": 0, "a": 1},
              {"a": "x", "c": 0}, {"c": 0}, {"a": 1, "c": 0, "d": 2}]:
        assert rewritten_valid(out, x) == valid(schema, x), x
