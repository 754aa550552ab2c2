"""guided.grammar.json_schema.complement: neg(s) admits only instances that break s."""
from __future__ import annotations

import pytest

from guided.grammar.json_schema.sanitizer import Sanitizer
from helpers.json_schema import SAMPLES, rewritten_valid, valid

SCHEMAS = [
    {"type": "string"},
    {"type": ["integer", "string"], "minLength": 2},
    {"enum": [1, "a", None]},
    {"const": True},
    {"type": "integer", "minimum": 1, "maximum": 4},
    {"required": ["a", "b"]},
    {"properties": {"a": {"type": "integer"}}},
    {"anyOf": [{"type": "string"}, {"type": "array", "maxItems": 1}]},
    {"allOf": [{"type": "object"}, {"required": ["b"]}]},
    {"type": "array", "items": {"type": "integer"}},
    {"type": "string", "maxLength": 1},
]
# complements that keep every instance breaking s (no pattern, multipleOf, ...)
EXACT = [0, 2, 3, 5, 6, 7, 8, 10]


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_complement_never_admits_a_valid_instance(i):
    s = SCHEMAS[i]
    n = Sanitizer({}).neg(s, 0)
    assert n is not None
    for x in SAMPLES:
        if rewritten_valid(n, x):
            assert not valid(s, x), (s, n, x)
        elif i in EXACT:
            assert valid(s, x), (s, n, x)


def test_complement_of_string_enum_is_exact():
    n = Sanitizer({}).neg({"enum": ["a", "ab"]}, 0)
    for x in ["a", "ab", "", "b", "abc", "aa", 1, None]:
        assert rewritten_valid(n, x) == (x not in ("a", "ab")), x


def test_patterns_and_multiple_of_have_no_complement():
    s = Sanitizer({})
    assert s.neg({"pattern": "^a"}, 0) is None
    assert s.neg({"multipleOf": 2}, 0) is None
    # typed: only the other types remain (a subset of the complement)
    assert s.neg({"type": "string", "pattern": "^a"}, 0) == {
        "type": ["null", "boolean", "integer", "number", "array", "object"]}
