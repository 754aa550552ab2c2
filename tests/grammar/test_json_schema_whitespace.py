"""guided.grammar.json_schema.whitespace: the bounded default, compact, flexible, a custom run.

Grammars run through the `llguidance` Python package with SmolLM2's tokenizer.
"""
from __future__ import annotations

import json

import pytest

from guided.grammar.json_schema import BOUNDED_WHITESPACE, json_schema_grammar, whitespace_options
from helpers.json_schema import accepts, matcher

OBJ = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "inner": {"type": "object", "properties": {"deep": {"type": "array",
                                                            "items": {"type": "integer"}}}},
    },
    "required": ["name"],
}
DOC = {"name": "x", "tags": ["a", "b"], "inner": {"deep": [1, 2, [3][0]]}}


# ------------------------------------------------------------------ whitespace

@pytest.mark.parametrize("text", [
    json.dumps(DOC, separators=(",", ":")),
    json.dumps(DOC),
    json.dumps(DOC, indent=2),
    json.dumps(DOC, indent=4),
    json.dumps(DOC, indent="\t"),
])
def test_default_whitespace_accepts_compact_and_indented(tok, text):
    assert accepts(tok, OBJ, text)


@pytest.mark.parametrize("text", [
    '{"name":"x",' + " " * 9 + '"tags":[]}',          # a run of spaces
    '{\n\n  "name": "x"}',                             # a blank line
    '{\n' + " " * 33 + '"name": "x"}',                 # indentation past the bound
    '{"name": "x"}\n\n',                               # trailing newlines
])
def test_default_whitespace_refuses_unbounded_runs(tok, text):
    assert not accepts(tok, OBJ, text)


def test_whitespace_cannot_run_forever(tok):
    """A model that keeps choosing whitespace is stopped within a bounded number of tokens."""
    hf, _ = tok
    m = matcher(tok, OBJ)
    ws_ids = [i for i in range(hf.get_vocab_size()) if (s := hf.decode([i])) and not s.strip()
              and set(s) <= set(" \t\r\n")]
    assert m.consume_token(hf.encode("{", add_special_tokens=False).ids[0])
    steps = 0
    while steps < 200:
        mask = m.compute_bitmask()
        allowed = [t for t in ws_ids if mask[t // 8] >> (t % 8) & 1]
        if not allowed:
            break
        assert m.consume_token(allowed[0])
        steps += 1
    assert steps < 200


def test_compact_and_flexible_overrides(tok):
    assert accepts(tok, OBJ, json.dumps(DOC, separators=(",", ":")), "compact")
    assert not accepts(tok, OBJ, json.dumps(DOC, indent=2), "compact")
    assert accepts(tok, OBJ, '{\n\n\n' + " " * 100 + '"name": "x"}', "flexible")
    assert accepts(tok, OBJ, '{ "name" : "x" }', r"[ ]")
    assert not accepts(tok, OBJ, '{\n"name":"x"}', r"[ ]")
    with pytest.raises(ValueError):
        whitespace_options("")


def test_client_cannot_relax_options():
    schema = {"type": "object", "x-guidance": {"lenient": True, "coerce_one_of": True}}
    entry = json_schema_grammar(schema)["json_schema"]
    assert entry["x-guidance"]["lenient"] is False
    assert entry["x-guidance"]["coerce_one_of"] is False
    assert entry["x-guidance"]["whitespace_pattern"] == BOUNDED_WHITESPACE
