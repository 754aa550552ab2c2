"""Regex helpers: the complement of a finite set of strings, and the first characters a pattern
can match (used to prove two patterns disjoint)."""
from __future__ import annotations

from typing import Iterator


def rx_escape(ch: str) -> str:
    if ch in "\\^$.|?*+()[]{}-":
        return "\\" + ch
    if ord(ch) < 0x20:
        return "\\x%02x" % ord(ch)
    return ch


def complement_strings_regex(words: list[str]) -> str | None:
    """An anchored regex for every string not in ``words`` (small sets only)."""
    if len(words) > 64 or sum(len(w) for w in words) > 2000:
        return None
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def alt(node) -> str:
        # strings that start at this trie node and are not words
        options = []
        kids = sorted(k for k in node if k != "")
        if kids:
            cls = "".join(rx_escape(k) if k not in "]\\^-" else "\\" + k for k in kids)
            options.append(f"[^{cls}][\\s\\S]*")
        else:
            options.append(r"[\s\S]+")
        for k in kids:
            options.append(rx_escape(k) + "(?:" + alt(node[k]) + ")")
        if "" not in node:
            options.append("")
        return "|".join(options)

    return "^(?:" + alt(trie) + ")$"


def search(pattern: str, value: str) -> bool:
    """Whether value matches the pattern (True when unsure: Python's re differs from ECMA 262)."""
    import re
    try:
        return re.search(pattern, value) is not None
    except (re.error, RecursionError):
        return True


CLASS_ESC = {
    "d": set("0123456789"),
    "w": set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"),
}


def first_chars(pattern: str) -> set[str] | None:
    """The characters a match of an anchored pattern (^...) can start with; None if unknown
    or if it can match the empty string."""
    if not pattern.startswith("^"):
        return None
    alts = top_level_alternatives(pattern)
    if alts is None or len(alts) > 1:  # then the '^' covers one alternative only
        return None
    return _fc(pattern[1:])


def _marks(rx: str) -> Iterator[tuple[int, str]]:
    """(position, character) of each '(', ')' and '|' in rx outside escapes
    and character classes, in order; (position, "") for a character class
    that is never closed, and nothing after it."""
    j = 0
    while j < len(rx):
        ch = rx[j]
        if ch == "\\":
            j += 2
            continue
        if ch == "[":
            k = rx.find("]", j + 2)
            if k < 0:
                yield j, ""
                return
            j = k + 1
            continue
        if ch in "()|":
            yield j, ch
        j += 1


def top_level_alternatives(rx: str) -> list[str] | None:
    """rx split at its top-level '|' (outside groups, classes and escapes);
    None if a character class is never closed."""
    alts, depth, start = [], 0, 0
    for j, ch in _marks(rx):
        if not ch:
            return None
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif depth == 0:
            alts.append(rx[start:j])
            start = j + 1
    alts.append(rx[start:])
    return alts


def _group_end(rx: str) -> int | None:
    """The position of the ')' that closes the group rx starts with; None
    if it is never closed."""
    depth = 0
    for j, ch in _marks(rx):
        if not ch:
            return None
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == ")" and depth == 0:
            return j
    return None


def _fc(rx: str) -> set[str] | None:
    if not rx:
        return None
    c = rx[0]
    if c == "(":
        i = _group_end(rx)
        if i is None:
            return None
        inner, after = rx[1:i], rx[i + 1:]
        if after[:1] in ("?", "*") or after.startswith("{0"):
            return None
        if inner.startswith("?:"):
            inner = inner[2:]
        elif inner.startswith("?"):
            return None
        alts = top_level_alternatives(inner)
        if alts is None:
            return None
        out: set[str] = set()
        for a in alts:
            f = _fc(a)
            if f is None:
                return None
            out |= f
        return out
    if c == "\\":
        if len(rx) < 2:
            return None
        e = rx[1]
        atom, rest = (CLASS_ESC.get(e) if e in CLASS_ESC else
                      ({e} if not e.isalnum() else None)), rx[2:]
        if atom is None:
            return None
    elif c == "[":
        j = rx.find("]", 2)
        if j < 0 or rx[1] == "^":
            return None
        body, rest = rx[1:j], rx[j + 1:]
        atom = set()
        k = 0
        while k < len(body):
            ch = body[k]
            if ch == "\\":
                if k + 1 >= len(body):
                    return None
                e = body[k + 1]
                if e in CLASS_ESC:
                    atom |= CLASS_ESC[e]
                elif not e.isalnum():
                    atom.add(e)
                else:
                    return None
                k += 2
                continue
            if k + 2 < len(body) and body[k + 1] == "-":
                lo, hi = ord(ch), ord(body[k + 2])
                if hi < lo or hi - lo > 256:
                    return None
                atom |= {chr(x) for x in range(lo, hi + 1)}
                k += 3
                continue
            atom.add(ch)
            k += 1
    elif c in ".^$|)*+?{":
        return None
    else:
        atom, rest = {c}, rx[1:]
    if rest[:1] in ("?", "*") or rest.startswith("{0") or rest.startswith("{,"):
        return None
    return atom
