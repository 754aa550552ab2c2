"""Building llguidance grammars structurally: named rules made of small
expressions, plus named sub-grammars (JSON schemas) referenced as ``@name``.

Composed grammars are assembled from these parts, never by editing Lark
text, so a client's schema or a tool name can never change the structure
around it: every literal goes through :func:`lit`, every token through
:func:`token`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

Expr = str  # a Lark expression, only ever produced by the helpers below


def lit(text: str) -> Expr:
    """A literal string (JSON escaping is valid Lark string escaping)."""
    return json.dumps(text, ensure_ascii=False)


def token(token_id: int) -> Expr:
    """Exactly the token ``token_id`` (a special token, by id)."""
    return f"<[{int(token_id)}]>"


def seq(*parts: Expr) -> Expr:
    kept = [p for p in parts if p and p != '""']
    return " ".join(kept) if kept else '""'


def alt(*parts: Expr) -> Expr:
    return "(" + " | ".join(parts) + ")"


def opt(part: Expr) -> Expr:
    return f"({part})?"


def star(part: Expr) -> Expr:
    return f"({part})*"


def regex(pattern: str) -> Expr:
    """A regex lexeme (Rust regex syntax, plus llguidance's ``&`` and ``~``
    between lexemes)."""
    return "/" + pattern.replace("/", "\\/") + "/"


_REGEX_META = set("\\.+*?()|[]{}^$#&-~")
_REGEX_CONTROL = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def regex_literal(text: str) -> str:
    """``text`` as a regex that matches exactly it (Rust regex syntax; newlines
    written as \\n so the pattern stays on one Lark line)."""
    return "".join(_REGEX_CONTROL.get(c) or ("\\" + c if c in _REGEX_META else c) for c in text)


def text_without(*forbidden: str, anchored: bool = False, suffix: str = "", visible: bool = False) -> Expr:
    """Any non-empty text (``visible``: with a character that is not
    whitespace), followed by ``suffix``, that does not contain (``anchored``:
    start with) any of ``forbidden``: an expression for
    :meth:`GrammarBuilder.lexeme`. One lexeme, so that a greedy text cannot
    swallow the suffix something else needs."""
    body = regex((r"(?s:.*\S.*)" if visible else r"(?s:.+)") + regex_literal(suffix))
    for f in forbidden:
        esc = regex_literal(f)
        body += " & ~" + regex(f"(?s:{esc}.*)" if anchored else f"(?s:.*{esc}.*)")
    return body


_NAME = re.compile(r"[a-z_][a-z0-9_]*")


@dataclass
class GrammarBuilder:
    """Rules (``start`` first) and JSON sub-grammars → TopLevelGrammar JSON."""

    rules: dict[str, Expr] = field(default_factory=dict)
    lexemes: dict[str, Expr] = field(default_factory=dict)
    subgrammars: dict[str, dict] = field(default_factory=dict)

    def rule(self, name: str, expr: Expr, *, suffix: str | None = None) -> Expr:
        """Define ``name`` (a fresh lowercase name) and return a reference to it.
        ``suffix`` makes it lazy: it ends at the first occurrence of that
        text, which it includes. (No ``max_tokens``: it would forbid the
        rollback the closing search needs.)"""
        if not _NAME.fullmatch(name) or name in self.rules:
            raise ValueError(f"bad or duplicate rule name {name!r}")
        attrs = [f"suffix={lit(suffix)}"] if suffix else []
        self.rules[name] = f"{name}{'[' + ', '.join(attrs) + ']' if attrs else ''}: {expr}"
        return name

    def lexeme(self, expr: Expr) -> Expr:
        """A token (lexeme) definition for ``expr``, returned by name; ``&``
        and ``~`` between regexes are allowed only in these."""
        name = f"LEX_{len(self.lexemes)}"
        self.lexemes[name] = f"{name}: {expr}"
        return name

    def subgrammar(self, name: str, entry: dict) -> Expr:
        """Add a grammar entry (e.g. ``{"json_schema": ...}``); returns ``@name``."""
        if not _NAME.fullmatch(name) or name in self.subgrammars:
            raise ValueError(f"bad or duplicate sub-grammar name {name!r}")
        self.subgrammars[name] = {**entry, "name": name}
        return f"@{name}"

    def build(self) -> str:
        if "start" not in self.rules:
            raise ValueError("a grammar needs a start rule")
        ordered = [self.rules["start"]] + [r for n, r in self.rules.items() if n != "start"] + \
            list(self.lexemes.values())
        main = {"lark_grammar": "\n".join(ordered) + "\n"}
        return json.dumps({"grammars": [main, *self.subgrammars.values()]}, ensure_ascii=False)
