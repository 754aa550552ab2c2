"""Composition of constraint grammars: a request's ``structured_outputs`` →
llguidance grammar JSON text (a TopLevelGrammar), compiled in Rust.

``structured_outputs`` holds exactly one of:

- ``"json"``: a JSON Schema (dict, bool, or its JSON text), sanitised by
  :func:`guided.grammar.json_schema.json_schema_grammar`; ``"whitespace"``
  beside it overrides the bounded default ("compact", "flexible", "bounded"
  or a regex for one whitespace run).
- ``"json_object"``: ``True``: any JSON object (OpenAI's and vLLM's
  json_object mode).
- ``"regex"``: a regular expression (Rust regex syntax) the whole output
  matches.
- ``"choice"``: a non-empty list of strings; the output is exactly one.
- ``"grammar"``: an llguidance Lark grammar (``%json``, lexeme attributes
  such as ``[max_tokens=...]``), or a GBNF one (llama.cpp's ``root ::=``,
  as in vLLM's examples), converted by llguidance's own converter. Special tokens (``<[123]>`` or by name)
  only with ``"allow_special_tokens": True`` beside it (DESIGN rule 7: a
  client grammar must not make the model write control tokens unless the
  operator allows it).
- ``"structural_tag"``: free text with tagged JSON structures, see
  :mod:`guided.grammar.structural_tag`.

``"on_length"`` beside any of them says what happens when the output
reaches its budget (max_tokens or the context):

- ``"close"`` (the default): near the budget the output is steered to the
  shortest completion the grammar accepts and ends on an end token inside
  max_tokens, with finish_reason "stop" and ``closed`` set (the structure
  is whole; a value may be short). A request whose shortest complete
  output cannot fit in max_tokens is refused before it starts.
- ``"close_as_length"``: closed the same way, reported as "length" (for
  clients that treat any output cut by the budget as truncated).
- ``"cut"``: the text as it stood at the budget, finish_reason "length".
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

CONSTRAINT_KEYS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
#: the constraints that write JSON (the only ones "whitespace" applies to)
JSON_KEYS = ("json", "json_object")
OPTION_KEYS = ("whitespace", "allow_special_tokens", "on_length")
ON_LENGTH = ("close", "close_as_length", "cut")


def check_structured_outputs(so: Any) -> None:
    """Raise ValueError unless ``so`` names exactly one known constraint
    (its content is checked when it is compiled)."""
    if not isinstance(so, dict):
        raise ValueError(f"structured_outputs must be a dict, got {type(so).__name__}")
    unknown = sorted(set(so) - set(CONSTRAINT_KEYS) - set(OPTION_KEYS))
    if unknown:
        raise ValueError(f"structured_outputs: unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"expected one of {', '.join(CONSTRAINT_KEYS)}")
    given = [k for k in CONSTRAINT_KEYS if k in so]
    if len(given) != 1:
        raise ValueError(f"structured_outputs needs exactly one of {', '.join(CONSTRAINT_KEYS)}, "
                         f"got {given or 'none'}")
    if "whitespace" in so and given[0] not in JSON_KEYS:
        raise ValueError("structured_outputs: 'whitespace' applies only to 'json' and 'json_object'")
    if "json_object" in so and so["json_object"] is not True:
        raise ValueError("structured_outputs['json_object'] must be true")
    if not isinstance(so.get("allow_special_tokens", False), bool):
        raise ValueError("structured_outputs: 'allow_special_tokens' must be a boolean")
    check_on_length(so.get("on_length"), "structured_outputs['on_length']")


@dataclass(frozen=True)
class ComposedGrammar:
    """A composed grammar (TopLevelGrammar JSON text), what an output that
    reaches its budget does (``on_length``, see the module's doc), and
    where a reasoning block must end."""

    text: str
    on_length: str = "close"
    #: a reasoning block's end token and the output length by which it must
    #: come (the engine writes it there); None: no reasoning budget
    reasoning_end: tuple[int, int] | None = None


def check_on_length(value: Any, where: str) -> None:
    if value is not None and value not in ON_LENGTH:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, ON_LENGTH))}, got {value!r}")


def on_length(options: dict | None) -> str:
    """What an output does at its budget: ``options["on_length"]``
    (structured_outputs or response_format) where given, else "close",
    for every kind of constraint."""
    return (options or {}).get("on_length") or "close"


def compose(so: dict) -> ComposedGrammar:
    """The grammar of a request's ``structured_outputs``, composed where the
    request enters (the engine takes only composed grammars); raises
    ValueError on malformed content."""
    return ComposedGrammar(json.dumps({"grammars": [constraint_entry(so)]}), on_length(so))


def constraint_entry(so: dict) -> dict:
    """The one llguidance grammar entry for ``structured_outputs`` (a chat
    answer embeds it as a sub-grammar); raises ValueError on malformed content."""
    check_structured_outputs(so)
    kind = next(k for k in CONSTRAINT_KEYS if k in so)
    value = so[kind]
    if kind == "json":
        entry = _json_entry(value, so.get("whitespace"))
    elif kind == "json_object":
        entry = _json_entry({"type": "object"}, so.get("whitespace"))
    elif kind == "regex":
        if not isinstance(value, str):
            raise ValueError("structured_outputs['regex'] must be a string")
        entry = _lark(f"start: /{regex_for_lark(value)}/")
    elif kind == "choice":
        entry = _lark(f"start: {choice_rule(value)}")
    elif kind == "structural_tag":
        from .structural_tag import structural_tag_entry
        entry = structural_tag_entry(value)
    else:
        if not isinstance(value, str) or not value.strip():
            raise ValueError("structured_outputs['grammar'] must be a non-empty Lark grammar string")
        value = _as_lark(value)
        named = special_token_refs(value)
        if named and not so.get("allow_special_tokens", False):
            raise ValueError(f"structured_outputs['grammar'] names special tokens ({', '.join(named[:3])}); "
                             "they are allowed only with 'allow_special_tokens': True")
        entry = _lark(value)
    return entry


def _json_entry(schema: Any, whitespace: str | None) -> dict:
    from .json_schema import json_schema_grammar
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs['json'] is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("structured_outputs['json'] must be a JSON Schema (an object or a boolean)")
    return json_schema_grammar(schema, whitespace)


def _as_lark(grammar: str) -> str:
    """A Lark grammar as given; a GBNF one converted to Lark."""
    from llguidance.gbnf_to_lark import any_to_lark
    try:
        return any_to_lark(grammar)
    except Exception as exc:   # the converter raises its own error types
        raise ValueError(f"structured_outputs['grammar'] is neither Lark (it has no 'start:' rule) "
                         f"nor GBNF: {exc}") from None


def _lark(text: str) -> dict:
    return {"lark_grammar": text}


def regex_for_lark(rx: str) -> str:
    """A regex as the body of a Lark ``/.../`` lexeme: an unescaped ``/``
    would end it early, so it gets a backslash."""
    out, escaped = [], False
    for c in rx:
        if c == "/" and not escaped:
            out.append("\\/")
        else:
            out.append(c)
        escaped = c == "\\" and not escaped
    return "".join(out)


def choice_rule(choices: Any) -> str:
    """Alternatives of literal strings, each a JSON-escaped Lark string."""
    if not isinstance(choices, (list, tuple)) or not choices:
        raise ValueError("structured_outputs['choice'] must be a non-empty list of strings")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError("structured_outputs['choice'] must hold non-empty strings")
    return " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


_LARK_SKIP = re.compile(r'"(?:[^"\\\n]|\\.)*"|/(?:[^/\\\n]|\\.)+/|//[^\n]*|#[^\n]*')
_SPECIAL_REF = re.compile(r"<[^<>\s]+>")


def special_token_refs(lark: str) -> list[str]:
    """The special-token references (``<[12]>``, ``<|im_end|>``) in a Lark
    grammar, outside strings, regexes and comments."""
    return _SPECIAL_REF.findall(_LARK_SKIP.sub(" ", lark))
