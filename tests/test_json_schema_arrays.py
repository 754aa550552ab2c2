"""guided.grammar.json_schema.arrays: uniqueItems and contains rewrites."""
from __future__ import annotations

import pytest

from guided.grammar.json_schema import sanitize_json_schema

from json_schema_check import rewritten_valid, valid

ARRAYS = [[], [1], [5], [1, 5], [5, 1], [1, 1], [5, 5], [1, 2, 3], ["a"], ["a", "a"]]


@pytest.mark.parametrize("schema", [
    {"type": "array", "uniqueItems": True},
    {"type": "array", "items": {"const": "a"}, "uniqueItems": True},
    {"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 5}},
    {"type": "array", "contains": {"type": "integer"}, "items": {"type": "integer"}},
    {"type": "array", "contains": False},
    {"type": "array", "contains": {"const": 1}, "maxContains": 1},
])
def test_array_rewrites_never_widen(schema):
    out, _ = sanitize_json_schema(schema)
    for x in ARRAYS:
        if rewritten_valid(out, x):
            assert valid(schema, x), (out, x)


def test_contains_implied_by_items_is_exact():
    schema = {"type": "array", "contains": {"type": "integer"}, "items": {"type": "integer"}}
    out, notes = sanitize_json_schema(schema)
    assert out == {"type": "array", "items": {"type": "integer"}, "minItems": 1} and not notes
