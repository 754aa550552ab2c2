"""guided.grammar.json_schema.checks: malformed keyword values are ValueErrors naming keyword and path."""
from __future__ import annotations

import pytest

from guided.grammar.json_schema import json_schema_grammar, sanitize_json_schema


@pytest.mark.parametrize("schema,where,keyword", [
    ({"type": "object", "minProperties": "x"}, "#", "minProperties"),
    ({"properties": {"a": {"maxLength": -1}}}, "#/properties/a", "maxLength"),
    ({"properties": {"a": {"type": "strin"}}}, "#/properties/a", "type"),
    ({"required": "a"}, "#", "required"),
    ({"anyOf": {}}, "#", "anyOf"),
    ({"items": {"minimum": "0"}}, "#/items", "minimum"),
    ({"multipleOf": 0}, "#", "multipleOf"),
    ({"properties": {"a": 3}}, "#", "properties"),
    ({"$defs": {"d": {"enum": "x"}}, "$ref": "#/$defs/d"}, "(ref r0)", "enum"),
])
def test_malformed_keyword_is_a_value_error(schema, where, keyword):
    with pytest.raises(ValueError) as e:
        sanitize_json_schema(schema)
    msg = str(e.value)
    assert f"'{keyword}'" in msg and where in msg, msg
    with pytest.raises(ValueError):
        json_schema_grammar(schema)


def test_well_formed_values_pass():
    out, _ = sanitize_json_schema({"type": ["string", "null"], "maxLength": 3.0, "minimum": 1.5,
                                   "required": [], "items": [{"type": "integer"}]})
    assert out["maxLength"] == 3.0
