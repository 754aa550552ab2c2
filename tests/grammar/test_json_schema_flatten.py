"""guided.grammar.json_schema.flatten: a type beside an anyOf of refs moves into the options."""
from __future__ import annotations

from guided.grammar.json_schema import sanitize_json_schema
from helpers.json_schema import SAMPLES, rewritten_valid, valid


def test_type_pushed_into_referenced_options():
    schema = {"type": "object", "anyOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}],
              "$defs": {"a": {"required": ["a"]}, "b": {"type": ["object", "string"],
                                                         "required": ["b"]}}}
    out, _ = sanitize_json_schema(schema)
    assert "type" not in out and set(out) == {"anyOf", "$defs"}
    for x in SAMPLES:
        assert rewritten_valid(out, x) == valid(schema, x), x


def test_options_of_other_types_dropped():
    out, _ = sanitize_json_schema({"type": "string", "anyOf": [{"type": "string", "minLength": 1},
                                                               {"type": "integer"}]})
    assert out == {"type": "string", "minLength": 1}
