"""guided.grammar.json_schema.one_of: oneOf as anyOf when disjoint, else with complements."""
from __future__ import annotations

from guided.grammar.json_schema import sanitize_json_schema
from helpers.json_schema import SAMPLES, rewritten_valid, valid


def test_disjoint_options_become_any_of():
    schema = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
    out, notes = sanitize_json_schema(schema)
    assert out == {"anyOf": [{"type": "string"}, {"type": "integer"}]} and not notes


def test_overlapping_options_exclude_each_other_exactly():
    schema = {"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}
    out, _ = sanitize_json_schema(schema)
    for x in SAMPLES:
        assert rewritten_valid(out, x) == valid(schema, x), x


def test_inexpressible_overlap_drops_the_option():
    schema = {"oneOf": [{"type": "integer"}, {"multipleOf": 2}]}
    out, notes = sanitize_json_schema(schema)
    assert any("oneOf" in n for n in notes)
    for x in SAMPLES + [4, 3.0, 6.5]:
        if rewritten_valid(out, x):
            assert valid(schema, x), x
