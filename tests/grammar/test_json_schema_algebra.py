"""guided.grammar.json_schema.algebra: canonical values and self-simplifying anyOf/allOf."""
from __future__ import annotations

from guided.grammar.json_schema.algebra import (all_of, any_of, as_schema, canon, json_type,
                                                type_set)


def test_canon_treats_equal_numbers_and_key_order_alike():
    assert canon(1) == canon(1.0)
    assert canon({"a": 1, "b": [2.0]}) == canon({"b": [2], "a": 1})
    assert canon(True) != canon(1)


def test_json_type():
    assert [json_type(v) for v in (None, True, 3, 3.0, 3.5, "s", [], {})] == [
        "null", "boolean", "integer", "integer", "number", "string", "array", "object"]


def test_any_of_and_all_of_simplify():
    assert any_of([False, {"type": "string"}]) == {"type": "string"}
    assert any_of([{"type": "string"}, {}]) is True
    assert any_of([False, {"enum": []}]) is False
    assert all_of([True, {"type": "string"}]) == {"type": "string"}
    assert all_of([{"type": "string"}, False]) is False
    assert all_of([{"minimum": 1}, {"maximum": 2}]) == {"allOf": [{"minimum": 1}, {"maximum": 2}]}


def test_type_set_and_boolean_schemas():
    assert type_set("number") == {"number", "integer"}
    assert type_set(["string", "null"]) == {"string", "null"}
    assert as_schema(True) == {} and as_schema(False) is False
