"""guided.grammar.json_schema.literals: an enum or const beside other keywords becomes the
listed values the whole node accepts."""
from __future__ import annotations

import json

import pytest

from guided.grammar.json_schema import sanitize_json_schema
from helpers.json_schema import SAMPLES, accepts, rewritten_valid, valid

D7 = "http://json-schema.org/draft-07/schema#"


@pytest.mark.parametrize("schema, kept", [
    ({"type": "string", "enum": ["a", "bb", "ccc"], "minLength": 2}, ["bb", "ccc"]),
    ({"allOf": [{"enum": [{"foo": "bar"}]}, {"not": {"enum": [{"baz": "bax", "foo": "bar"}]}}]},
     [{"foo": "bar"}]),
    ({"allOf": [{"enum": [{"a_X_3": 3}, {"a_X_4": "s"}]},
                {"not": {"patternProperties": {"X_": {"type": "string"}}}}]}, [{"a_X_3": 3}]),
    ({"$defs": {"short": {"maxLength": 1}}, "enum": ["a", "bb"], "allOf": [{"$ref": "#/$defs/short"}]},
     ["a"]),
    ({"const": 2, "multipleOf": 2}, [2]),
])
def test_the_values_the_node_accepts(schema, kept):
    out, _ = sanitize_json_schema(schema)
    assert out == {"enum": kept}
    for x in SAMPLES + kept:
        assert rewritten_valid(out, x) == valid(schema, x), x


def test_none_accepted_is_false_and_formats_are_asserted():
    assert sanitize_json_schema({"enum": [1, 2], "minimum": 5})[0] is False
    assert sanitize_json_schema({"const": "2020-13-01", "format": "date"})[0] is False


def test_a_plain_enum_is_left_alone():
    schema = {"type": "string", "enum": ["a", "b"], "description": "x"}
    assert sanitize_json_schema(schema)[0] == {"type": "string", "enum": ["a", "b"]}


def test_const_is_not_a_keyword_in_draft_4():
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "const": 5, "minimum": 1}
    out, _ = sanitize_json_schema(schema)
    assert rewritten_valid(out, 6) and valid(schema, 6)


def test_keywords_beside_ref_are_ignored_before_2019():
    schema = {"$schema": D7, "definitions": {"one": {"maxLength": 1}},
              "enum": ["a", "bb"], "$ref": "#/definitions/one"}
    out, _ = sanitize_json_schema(schema)
    assert "enum" not in json.dumps(out)   # draft 7: the enum beside $ref is not a keyword
    assert rewritten_valid(out, "z") and valid(schema, "z")


def test_through_the_grammar(tok):  # noqa: F811
    schema = {"type": "object", "properties": {"size": {"enum": [1, 2, 3, 40], "minimum": 2}},
              "required": ["size"], "additionalProperties": False}
    assert accepts(tok, schema, '{"size": 40}')
    assert not accepts(tok, schema, '{"size": 1}')
