"""guided.grammar.json_schema.formats: patterns for formats llguidance lacks."""
from __future__ import annotations

import re

import pytest

from guided.grammar.json_schema.formats import FORMAT_PATTERNS, RELATIVE_REF

CASES = {
    "json-pointer": (["", "/a", "/a~0b/~1"], ["a", "/a~2"]),
    "relative-json-pointer": (["0", "1/a", "2#"], ["-1", "/a", "01"]),
    "uri-template": (["http://x/{a}", "/p{?q,r}", "a{+b:3}"], ["http://x/{", "a b", "{}"]),
    "regex": (["abc", r"a\.b"], ["(", "a*"]),
}


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_format_patterns(fmt):
    good, bad = CASES[fmt]
    rx = re.compile(FORMAT_PATTERNS[fmt])
    assert all(rx.search(s) for s in good), fmt
    assert not any(rx.search(s) for s in bad), fmt


def test_relative_reference():
    rx = re.compile("^" + RELATIVE_REF + "$")
    assert all(rx.search(s) for s in ["a/b", "/x?y#z", "../c", ""])
    assert not rx.search("a b")
