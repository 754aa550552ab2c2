"""Helpers for the json_schema unit tests: a JSON Schema validator as the reference."""
from __future__ import annotations

import json

import pytest

from guided.grammar.json_schema import json_schema_grammar
from helpers.structured import validator

jsonschema = pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance")

#: values of every JSON type, for checking a rewrite against the original schema
SAMPLES = [None, True, False, 0, 1, 2, 5, -3, 2.5, "", "a", "ab", "xyz", [], [1], [1, 2], ["a", "a"],
           {}, {"a": 1}, {"b": "x"}, {"a": 1, "b": 2}, {"a": "s", "b": None}]


def valid(schema, instance) -> bool:
    return validator(schema).is_valid(instance)


def rewritten_valid(sanitized, instance) -> bool:
    """Validity under a sanitised schema (its $defs are draft 2020-12)."""
    if sanitized is True or sanitized is False:
        return sanitized
    return jsonschema.Draft202012Validator(sanitized).is_valid(instance)


def matcher(tok, schema, whitespace=None):
    hf, lt = tok
    grammar = json.dumps({"grammars": [json_schema_grammar(schema, whitespace)]})
    m = llguidance.LLMatcher(lt, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(tok, schema, text: str, whitespace=None) -> bool:
    hf, _ = tok
    m = matcher(tok, schema, whitespace)
    ids = hf.encode(text, add_special_tokens=False).ids
    return all(m.consume_token(t) for t in ids) and m.is_accepting()
