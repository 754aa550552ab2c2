"""guided.grammar.json_schema.property_order: keys in other orders than the schema's, exactly.

Each rewrite must accept exactly the instances the schema accepts (checked with a validator),
and the grammar must take the keys in the orders instances use (checked through llguidance).
"""
from __future__ import annotations

import itertools
import json

import pytest

from guided.grammar.json_schema import sanitize_json_schema
from helpers.json_schema import accepts, rewritten_valid, valid

SMALL = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                          "c": {"type": "boolean"}},
         "required": ["a", "b"], "additionalProperties": False}
OPTIONAL = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"},
                                             "z.w": {"type": "null"}}}
MIXED = {"type": "object", "required": ["id", "kind"],
         "properties": {n: {"type": "string"} for n in ["desc", "id", "kind", "name", "tags"]}}


def _objects(names, values):
    for k in range(len(names) + 1):
        for keys in itertools.permutations(names, k):
            yield {n: values[n] for n in keys}


@pytest.mark.parametrize("schema", [SMALL, OPTIONAL, MIXED])
def test_rewrite_accepts_exactly_the_schemas_instances(schema):
    out, _ = sanitize_json_schema(schema)
    good = {"a": 1, "b": "s", "c": True, "x": 1, "y": "s", "z.w": None, "desc": "d", "id": "i",
            "kind": "k", "name": "n", "tags": "t"}
    bad = {"a": "s", "b": 1, "c": 1, "x": "s", "y": 1, "z.w": 0, "desc": 1, "id": 1, "kind": None,
           "name": 1, "tags": 1}
    names = list(schema["properties"])[:4]
    for values in (good, bad):
        for inst in _objects(names, values):
            assert rewritten_valid(out, inst) == valid(schema, inst), (out, inst)
    for extra in ({"other": 1}, {"zzw": None}):
        assert rewritten_valid(out, extra) == valid(schema, extra)


@pytest.mark.parametrize("schema,doc", [
    (SMALL, {"a": 1, "b": "s", "c": True}),
    (MIXED, {"id": "i", "kind": "k", "desc": "d", "name": "n", "tags": "t"}),
])
def test_required_keys_in_either_order(tok, schema, doc):
    required = [k for k in doc if k in schema.get("required", [])]
    for first in itertools.permutations(required):
        order = list(first) + [k for k in schema["properties"] if k in doc and k not in first]
        text = json.dumps({k: doc[k] for k in order}, separators=(",", ":"))
        assert accepts(tok, schema, text), text
    in_schema_order = {k: doc[k] for k in schema["properties"] if k in doc}
    assert accepts(tok, schema, json.dumps(in_schema_order, separators=(",", ":")))


def test_no_key_twice(tok):
    assert not accepts(tok, SMALL, '{"a":1,"b":"s","a":2}')
    assert not accepts(tok, OPTIONAL, '{"x":1,"x":2}')


def test_wrong_values_still_refused_in_any_order(tok):
    assert not accepts(tok, SMALL, '{"b":"s","a":"1"}')
    assert not accepts(tok, SMALL, '{"b":"s"}')
    assert not accepts(tok, SMALL, '{"c":true,"b":"s","a":1,"d":0}')
    assert not accepts(tok, OPTIONAL, '{"y":"s","x":"1"}')


def test_objects_under_an_intersection_are_left_alone():
    schema = {"allOf": [{"$ref": "#/$defs/o"}, {"required": ["a"]}],
              "$defs": {"o": {"properties": {"a": {}, "b": {}}}}}
    out, _ = sanitize_json_schema(schema)
    assert "patternProperties" not in json.dumps(out)


def test_metadata_keys_may_come_first_at_the_root(tok):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
              "required": ["name"]}
    for text in ('{"$schema":"https://x.org/s.json","name":"a","size":1}', '{"name":"a","title":"t"}',
                 '{"name":"a","size":1}'):
        assert accepts(tok, schema, text), text
    # not where additional keys are refused, and each key still once with its schema
    closed = {**schema, "additionalProperties": False}
    assert not accepts(tok, closed, '{"$schema":"s","name":"a"}')
    typed = {**schema, "additionalProperties": {"type": "integer"}}
    assert not accepts(tok, typed, '{"$schema":"s","name":"a"}')
    assert accepts(tok, typed, '{"title":3,"name":"a"}')
