"""Patterns with lookarounds, which llguidance's regex engine lacks, where an exact rewrite exists:

* ``^(?!w)rest`` with a literal ``w``: ``^rest`` and a second pattern for the strings that do
  not start with ``w`` (``^(?!w$)`` : that are not ``w``); both must match (an allOf);
* an anchor that can never hold (``x^...`` or ``...$x`` with a literal ``x``, as in a pattern
  copied with its JavaScript slashes, ``/^...$/``): the pattern matches no string.
"""
from __future__ import annotations

from .regex import complement_strings_regex, top_level_alternatives

_META = set("\\.+*?()|[]{}^$")
_QUANTIFIERS = set("*+?{")


def _plain(ch: str) -> bool:
    return ch not in _META


def _literal(rx: str) -> str | None:
    """The string a regex of literal characters and escaped punctuation matches, else None."""
    out, i = [], 0
    while i < len(rx):
        ch = rx[i]
        if ch == "\\":
            if i + 1 >= len(rx) or rx[i + 1].isalnum():
                return None
            out.append(rx[i + 1])
            i += 2
            continue
        if not _plain(ch):
            return None
        out.append(ch)
        i += 1
    return "".join(out)


def literal_names(pattern: str) -> list[str] | None:
    """The names an anchored pattern of literal alternatives matches (``^a$``, ``^(a|b)$``,
    ``^(?:a|b)$``), else None."""
    if not (pattern.startswith("^") and pattern.endswith("$") and not pattern.endswith("\\$")):
        return None
    body = pattern[1:-1]
    grouped = False
    for opener in ("(?:", "("):
        if body.startswith(opener) and body.endswith(")"):
            inner = body[len(opener):-1]
            if "(" not in inner and ")" not in inner:
                body, grouped = inner, True
            break
    alts = top_level_alternatives(body)
    if alts is None or (len(alts) > 1 and not grouped):
        return None  # ^a|b$ is (^a)|(b$)
    names = [_literal(a) for a in alts]
    return None if any(n is None for n in names) else names


def _class_char(ch: str) -> str:
    return "\\" + ch if ch in "]\\^-[" else ch


def _esc(ch: str) -> str:
    return "\\" + ch if ch in _META or ch in "#&-~" else ch


def not_prefixed(word: str) -> str:
    """A pattern matching exactly the strings that do not start with ``word`` (non-empty).
    Its only anchors are the outer ones: llguidance takes no ``$`` inside a pattern."""
    rx = ""
    for ch in reversed(word):
        rx = f"|[^{_class_char(ch)}][\\s\\S]*" + (f"|{_esc(ch)}(?:{rx})" if rx else "")
    return f"^(?:{rx})$"


def never_matches(pattern: str) -> bool:
    """Whether an anchor in pattern can never hold (conservative: False when unsure)."""
    alts = top_level_alternatives(pattern)
    if alts is None or len(alts) != 1:
        return False
    p = pattern
    if len(p) >= 2 and _plain(p[0]) and p[1] == "^":
        return True
    return len(p) >= 3 and _plain(p[-1]) and p[-2] == "$" and p[-3] != "\\"


def split_negative_lookahead(pattern: str) -> list[str] | None:
    """Patterns whose conjunction is ``pattern`` for ``^(?!literal)rest``, else None."""
    if not pattern.startswith("^(?!"):
        return None
    alts = top_level_alternatives(pattern)
    if alts is None or len(alts) != 1:
        return None
    depth, i = 1, 4
    while i < len(pattern) and depth:
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        depth += {"(": 1, ")": -1}.get(ch, 0)
        i += 1
    if depth:
        return None
    inner, rest = pattern[4:i - 1], pattern[i:]
    if "(?" in rest or rest[:1] in _QUANTIFIERS:
        return None
    whole = inner.endswith("$") and not inner.endswith("\\$")
    word = _literal(inner[:-1] if whole else inner)
    if not word:
        return None
    if whole:
        forbid = complement_strings_regex([word])
    else:
        forbid = not_prefixed(word)
    if forbid is None:
        return None
    return ["^" + rest, forbid]


def rewrite_pattern(pattern: str) -> list[str] | bool | None:
    """False when pattern matches nothing, a list of patterns that all must match and
    together match what pattern matches, or None (no rewrite)."""
    if never_matches(pattern):
        return False
    return split_negative_lookahead(pattern)
