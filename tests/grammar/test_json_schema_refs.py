"""guided.grammar.json_schema.refs: $id bases, anchors, JSON pointers, one $defs table."""
from __future__ import annotations

import pytest

from guided.grammar.json_schema import sanitize_json_schema
from guided.grammar.json_schema.refs import ROOT_URI, Ctx, Unsupported
from guided.grammar.json_schema.sanitizer import Sanitizer


def _indexed(schema):
    s = Sanitizer(schema)
    s._index(schema, Ctx(2020, ROOT_URI), top=True)
    return s


def test_pointer_anchor_and_id_targets():
    schema = {"$id": "https://e.com/root.json",
              "$defs": {"a~/b": {"type": "integer"},
                        "named": {"$anchor": "here", "type": "string"},
                        "sub": {"$id": "sub.json", "type": "boolean"}}}
    s = _indexed(schema)
    ctx = s.ctx[id(schema)]
    assert s.target("#/$defs/a~0~1b", ctx)[0] == {"type": "integer"}
    assert s.target("#here", ctx)[0]["type"] == "string"
    node, sctx = s.target("https://e.com/sub.json", ctx)
    assert node["type"] == "boolean" and sctx.base == "https://e.com/sub.json"
    with pytest.raises(Unsupported):
        s.target("#/$defs/missing", ctx)
    with pytest.raises(Unsupported):
        s.target("https://elsewhere.com/x.json", ctx)


def test_every_reference_goes_through_one_defs_table():
    schema = {"type": "object", "properties": {"a": {"$ref": "#/definitions/n"}},
              "additionalProperties": {"$ref": "#/definitions/n"},
              "definitions": {"n": {"type": "integer"}}}
    out, _ = sanitize_json_schema(schema)
    assert out["$defs"] == {"r0": {"type": "integer"}}
    out = out["anyOf"][-1]  # the root as written (before it, the same with "$schema" etc. first)
    assert out["properties"]["a"] == out["additionalProperties"] == {"$ref": "#/$defs/r0"}


def test_draft7_ignores_keywords_beside_ref():
    schema = {"$schema": "http://json-schema.org/draft-07/schema#",
              "properties": {"a": {"$ref": "#/definitions/n", "maximum": 3}},
              "definitions": {"n": {"type": "integer"}}}
    out, _ = sanitize_json_schema(schema)
    assert out["anyOf"][-1]["properties"]["a"] == {"$ref": "#/$defs/r0"}
