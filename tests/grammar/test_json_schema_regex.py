"""guided.grammar.json_schema.regex: complements of word sets and first-character sets."""
from __future__ import annotations

import re

import pytest

from guided.grammar.json_schema.regex import (complement_strings_regex, first_chars, search,
                                              top_level_alternatives)

WORDS = ["a", "ab", "abc", "b-]", "", "x^y"]
PROBES = WORDS + ["abd", "ac", "b", "b-", "abcd", "zz", "x^", "x^yy", "\n", "-", "]"]


def test_complement_of_words_is_exact():
    rx = re.compile(complement_strings_regex(WORDS))
    for s in PROBES:
        assert (rx.search(s) is None) == (s in WORDS), s


def test_complement_refuses_large_sets():
    assert complement_strings_regex([str(i) for i in range(65)]) is None


@pytest.mark.parametrize("pattern,chars", [
    ("^abc", {"a"}),
    ("^[0-3]x", set("0123")),
    ("^(?:foo|bar)", {"f", "b"}),
    (r"^\d+", set("0123456789")),
    ("^a?b", None),        # may start with b too: unknown
    ("abc", None),         # not anchored
    ("^a|b", None),        # the anchor covers one alternative only
    ("^[^a]", None),
])
def test_first_chars(pattern, chars):
    assert first_chars(pattern) == chars


def test_top_level_alternatives_skip_groups_and_classes():
    assert top_level_alternatives("a(b|c)|[|]|d") == ["a(b|c)", "[|]", "d"]
    assert top_level_alternatives("[abc") is None


def test_search_is_true_when_python_cannot_tell():
    assert search("^a", "abc") and not search("^a", "b")
    assert search("(?<", "x")  # not a Python regex: unsure, so True
