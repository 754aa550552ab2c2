"""guided.grammar.json_schema.lookaround: exact rewrites of patterns llguidance cannot parse."""
from __future__ import annotations

import json
import re

import pytest

from guided.grammar.json_schema import sanitize_json_schema
from guided.grammar.json_schema.lookaround import (never_matches, not_prefixed, rewrite_pattern,
                                                   split_negative_lookahead)
from helpers.json_schema import accepts, rewritten_valid, valid

WORDS = ["", "o", "or", "org", "org.", "org.b", "org.bukkit.x", "orz", "x", "org-b", "\n"]


def test_not_prefixed_is_exact():
    rx = re.compile(not_prefixed("org.b"))
    for w in WORDS:
        assert bool(rx.search(w)) == (not w.startswith("org.b")), w


@pytest.mark.parametrize("pattern", [r"^(?!org\.b)[a-z.]+$", r"^(?!ab$)[a-z]*", r"^(?!x-)"])
def test_negative_lookahead_split_is_exact(pattern):
    parts = split_negative_lookahead(pattern)
    assert parts is not None
    for w in WORDS + ["ab", "abc", "x-1", "x", "a"]:
        want = re.search(pattern, w) is not None
        assert all(re.search(p, w) for p in parts) == want, (pattern, w)


def test_patterns_left_alone():
    assert split_negative_lookahead(r"^(?!a|b)c") is None      # not a literal
    assert split_negative_lookahead(r"^(?!a)b|c") is None      # the anchor covers one branch
    assert rewrite_pattern("^[a-z]+$") is None


def test_impossible_anchors():
    assert never_matches("/^[0-9]{4}$/")
    assert not never_matches("^a$") and not never_matches(r"^a\$/") and not never_matches("a|/^b")
    out, notes = sanitize_json_schema({"type": "object", "properties": {
        "d": {"type": "string", "pattern": "/^[0-9]{4}$/"},
        "e": {"$ref": "#/$defs/e"}}, "$defs": {"e": {"pattern": "/^x$/", "type": "string"}}})
    assert rewritten_valid(out, {}) and rewritten_valid(out, {"f": 1})
    assert not rewritten_valid(out, {"d": "1234"}) and not rewritten_valid(out, {"e": "x"})
    assert "$ref" not in json.dumps(out)  # the false definition is inlined
    assert any("no string" in n for n in notes)
    untyped, _ = sanitize_json_schema({"pattern": "/^x$/"})
    assert untyped == {"type": ["null", "boolean", "integer", "number", "array", "object"]}


def test_lookahead_schema_through_the_grammar(tok):
    schema = {"type": "string", "pattern": r"^(?!org\.bukkit\.)([a-z]+\.)*[a-z]+$"}
    for s in ["com.x", "org.bukkit", "org.bukkitx.a", "org.bukkit.a", "Org", "a..b"]:
        text = '"' + s + '"'
        assert accepts(tok, schema, text) == valid(schema, s), s
    out, _ = sanitize_json_schema(schema)
    assert rewritten_valid(out, "org.bukkit") and not rewritten_valid(out, "org.bukkit.a")


def test_literal_names():
    from guided.grammar.json_schema.lookaround import literal_names
    assert literal_names("^(relationships|links)$") == ["relationships", "links"]
    assert literal_names(r"^(?:a|b\.c)$") == ["a", "b.c"]
    assert literal_names("^a|b$") is None  # (^a)|(b$)
    assert literal_names(r"^\w$") is None and literal_names("^a") is None
