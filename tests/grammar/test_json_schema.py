"""guided.grammar.json_schema: sanitised schemas end to end, never accepting an invalid instance.

Fast, no model weights: grammars run through the `llguidance` Python package
(the engine's native Matcher uses the same crate) with SmolLM2's tokenizer,
read from the GGUF's metadata.
"""
from __future__ import annotations

import json

import pytest

from guided.grammar.json_schema import json_schema_grammar, sanitize_json_schema
from helpers.json_schema import accepts, valid


# ------------------------------------------------------------------ sanitising

def test_annotations_dropped():
    out, _ = sanitize_json_schema({"title": "t", "description": "d", "examples": [1],
                                   "$comment": "c", "default": 3, "type": "integer"})
    assert out == {"type": "integer"}


CASES = [
    # (schema, instances: some valid, some not)
    ({"not": {"type": "string"}}, [1, "a", None, [1], {"a": 1}, True]),
    ({"type": "object", "properties": {"a": {"not": {"enum": ["x", "y"]}}}},
     [{"a": "x"}, {"a": "y"}, {"a": "z"}, {"a": "xy"}, {"a": ""}, {"a": 1}, {}]),
    ({"type": "object", "not": {"required": ["a", "b"]}},
     [{"a": 1}, {"b": 1}, {"a": 1, "b": 2}, {}]),
    ({"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 5}]},
     [1, 5, 7, 5.5, 2.5, "a"]),
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}, "v": {"type": "integer"}},
                 "required": ["k"]},
                {"type": "object", "properties": {"k": {"const": "b"}, "v": {"type": "string"}},
                 "required": ["k"]}]},
     [{"k": "a", "v": 1}, {"k": "b", "v": "s"}, {"k": "a", "v": "s"}, {"k": "c"}]),
    ({"oneOf": [{"required": ["a"]}, {"required": ["b"]}], "type": "object"},
     [{"a": 1}, {"b": 1}, {"a": 1, "b": 1}, {}]),
    ({"type": "object", "properties": {"kind": {"type": "string"}, "n": {"type": "integer"}},
      "if": {"properties": {"kind": {"const": "num"}}, "required": ["kind"]},
      "then": {"required": ["n"]}, "else": {"properties": {"n": False}}},
     [{"kind": "num", "n": 1}, {"kind": "num"}, {"kind": "x"}, {"kind": "x", "n": 1}, {"n": 1}, {}]),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
      "properties": {"a": {}, "b": {}}, "dependencies": {"a": ["b"]}},
     [{"a": 1, "b": 2}, {"a": 1}, {"b": 2}, {}]),
    ({"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
      "properties": {"a": {}, "b": {"type": "integer"}},
      "dependentSchemas": {"a": {"required": ["b"]}}},
     [{"a": 1, "b": 2}, {"a": 1}, {"b": 2}, {"a": 1, "b": "x"}]),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     [[], [1], [1, 2], [1, 1]]),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 5}},
     [[5], [6, 1], [1, 6], [], [1, 2]]),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"type": "integer"}},
     [[1], [], [1, 2]]),
    ({"type": "string", "format": "uri-template"}, ["http://x/{a}", "http://x/{", "a b"]),
    ({"type": "string", "format": "json-pointer"}, ["", "/a/b~0", "a", "/a~2"]),
    ({"type": "string", "format": "not-a-real-format"}, ["anything"]),
    ({"type": ["integer", "string"], "not": {"type": "string", "multipleOf": 2}}, [1, 2, "a"]),
    ({"type": "object", "minProperties": 1, "properties": {"a": {}, "b": {}},
      "additionalProperties": False}, [{}, {"a": 1}, {"b": 1}, {"a": 1, "b": 2}]),
    ({"type": "object", "propertyNames": {"maxLength": 1}, "properties": {"a": {}, "bb": {}},
      "additionalProperties": False}, [{"a": 1}, {"bb": 1}, {}]),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "number",
      "minimum": 5, "exclusiveMinimum": True}, [5, 6]),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "const": 5}, [5, 6]),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
      "items": [{"type": "integer"}, {"type": "string"}], "additionalItems": False},
     [[1, "a"], [1], [1, "a", 2], ["a"]]),
]


@pytest.mark.parametrize("schema,instances", CASES, ids=[json.dumps(c[0])[:60] for c in CASES])
def test_sanitised_schema_never_accepts_invalid(tok, schema, instances):
    accepted_valid = 0
    for inst in instances:
        text = json.dumps(inst, separators=(",", ":"))
        ok = accepts(tok, schema, text)
        if ok:
            assert valid(schema, inst), f"invalid instance accepted: {text}"
        accepted_valid += ok
    assert accepted_valid > 0 or not any(valid(schema, i) for i in instances)


EXACT = [  # rewrites that keep exactly the valid instances
    CASES[0], CASES[1], CASES[2], CASES[4], CASES[5], CASES[6], CASES[7], CASES[8],
    CASES[11], CASES[14], CASES[16], CASES[18], CASES[19], CASES[20],
]


@pytest.mark.parametrize("schema,instances", EXACT, ids=[json.dumps(c[0])[:60] for c in EXACT])
def test_exact_rewrites_accept_every_valid_instance(tok, schema, instances):
    for inst in instances:
        text = json.dumps(inst, separators=(",", ":"))
        assert accepts(tok, schema, text) == valid(schema, inst), text


def test_inexpressible_schema_refused():
    with pytest.raises(ValueError, match="no instance"):
        json_schema_grammar({"type": "integer", "not": {"multipleOf": 2}})


def test_notes_for_narrowing():
    _, notes = sanitize_json_schema({"type": "array", "uniqueItems": True})
    assert any("uniqueItems" in n for n in notes)


def test_remote_ref_refused():
    with pytest.raises(ValueError, match="ref"):
        json_schema_grammar({"$ref": "https://example.com/schema.json"})


def test_refs_to_own_id_resolve(tok):
    schema = {"$id": "https://example.com/root.json", "type": "object",
              "properties": {"a": {"$ref": "https://example.com/root.json#/definitions/n"}},
              "definitions": {"n": {"type": "integer"}}}
    assert accepts(tok, schema, '{"a":1}')
    assert not accepts(tok, schema, '{"a":"x"}')


def test_not_enum_of_numbers_is_exact(tok):
    schema = {"type": "integer", "minimum": 1, "maximum": 10, "not": {"enum": [3, 4, 7]}}
    for n in range(0, 12):
        assert accepts(tok, schema, str(n)) == valid(schema, n), n
    assert not accepts(tok, schema, "7.5")
