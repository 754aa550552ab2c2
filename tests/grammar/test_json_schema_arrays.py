"""guided.grammar.json_schema.arrays: uniqueItems and contains rewrites."""
from __future__ import annotations

import json

import pytest

from guided.grammar.json_schema import sanitize_json_schema
from helpers.json_schema import accepts, rewritten_valid, valid

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


def test_unique_literal_items_are_exact(tok):
    schema = {"type": "array", "uniqueItems": True, "minItems": 1,
              "items": {"type": "string", "enum": ["a", "b", "c", 1]}}
    out, notes = sanitize_json_schema(schema)
    assert not notes
    cases = [[], ["a"], ["a", "b"], ["c", "a", "b"], ["a", "a"], ["b", "c", "b"], [1], ["d"]]
    for x in cases:
        assert rewritten_valid(out, x) == valid(schema, x), x
        text = json.dumps(x, separators=(",", ":"))
        assert accepts(tok, schema, text) == valid(schema, x), x


def test_unique_free_strings_still_capped():
    out, notes = sanitize_json_schema({"type": "array", "uniqueItems": True,
                                       "items": {"type": "string"}})
    assert out["maxItems"] == 1 and any("uniqueItems" in n for n in notes)
