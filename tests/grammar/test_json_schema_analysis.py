"""guided.grammar.json_schema.analysis: types, finite values, implication and disjointness."""
from __future__ import annotations

import pytest

from guided.grammar.json_schema.sanitizer import Sanitizer
from helpers.json_schema import SAMPLES, valid

S = Sanitizer({})


def test_types_and_values():
    assert S.types({"enum": [1, "a"]}, 0) == {"integer", "string"}
    assert S.types({"anyOf": [{"type": "string"}, {"type": "null"}]}, 0) == {"string", "null"}
    assert S.types({"minimum": 1}, 0) is None
    assert S.values({"allOf": [{"enum": [1, 2, 3]}, {"enum": [2, 3, 4]}]}, 0) == {"2", "3"}
    assert S.values({"type": "string"}, 0) is None


DISJOINT = [
    ({"type": "string"}, {"type": "integer"}),
    ({"const": "a"}, {"enum": ["b", "c"]}),
    ({"type": "string", "pattern": "^a"}, {"type": "string", "pattern": "^b"}),
    ({"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]},
     {"type": "object", "properties": {"k": {"const": 2}}, "required": ["k"]}),
    ({"type": "object", "required": ["a"]},
     {"type": "object", "properties": {"a": False}}),
]
OVERLAPPING = [
    ({"type": "integer"}, {"type": "number"}),
    ({"type": "string", "pattern": "^a"}, {"type": "string", "pattern": "b$"}),
    ({"required": ["a"]}, {"required": ["b"]}),
]


@pytest.mark.parametrize("a,b", DISJOINT)
def test_disjoint_proofs_hold(a, b):
    assert S.disjoint(a, b)
    assert not any(valid(a, x) and valid(b, x) for x in SAMPLES)


@pytest.mark.parametrize("a,b", OVERLAPPING)
def test_no_disjointness_claimed_for_overlaps(a, b):
    assert not S.disjoint(a, b)


def test_implies_is_conservative():
    assert S._implies({"type": "integer", "minimum": 3}, {"type": "number"})
    assert not S._implies({"minimum": 3}, {"type": "number"})
    assert S._string_matches({"maxLength": 2, "pattern": "^a"}, "ab")
    assert not S._string_matches({"format": "x", "minLength": 3}, "ab")
