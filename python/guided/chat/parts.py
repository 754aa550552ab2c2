"""The parts the format tables are written in (tool_formats.py: how a
family writes a call; message_formats.py: how it frames its reasoning and
its answer): marker tokens, literal text, the holes a call fills in, and
``OneOf`` for a stretch a model may spell several ways."""
from __future__ import annotations

from dataclasses import dataclass

from ..special_tokens import SpecialTokens


@dataclass(frozen=True)
class Special:
    """A marker: the model's added token spelled ``text`` where it has one,
    else that text (the template writes the marker as text). The tool-format
    table is the one place a tool-call marker is spelled; the registry finds it among
    the added tokens by its text, or by its name where it has one (the
    registry's MARKER_ROLES)."""

    text: str
    #: the registry's name for the marker where other modules ask for it by
    #: name (``registry.id("tool_call_start")``); else its text is its role
    name: str | None = None

    @property
    def role(self) -> str:
        return self.name or self.text


def resolve(part: "Special | Lit", special: SpecialTokens | None) -> tuple[int | None, str]:
    """(token id or None, text) of a fixed part."""
    tid = special.id(part.role) if isinstance(part, Special) and special is not None else None
    return tid, part.text


@dataclass(frozen=True)
class Lit:
    text: str


@dataclass(frozen=True)
class Hole:
    kind: str   # "name", "args", "call_id", "index", "is_string" or "type"


#: The tool's name, its arguments, an id the model writes (matching the
#: format's ``call_id``), the call's position in its message (written by the
#: model, never an id; counted from the format's ``first_index``), and
#: inside an argument's tag the words that say its value's type: "true"/"false"
#: for whether it is a string (DeepSeek V3.2's typed attribute), or its JSON
#: type (Kimi K3's, ``TYPE_WORDS``).
NAME, ARGS, CALL_ID, INDEX, IS_STRING, TYPE = (Hole("name"), Hole("args"), Hole("call_id"), Hole("index"),
                                               Hole("is_string"), Hole("type"))

#: The JSON types as a TYPE hole writes them (an integer is a "number").
TYPE_WORDS = ("string", "number", "boolean", "null", "object", "array")


def type_word(hole: Hole, json_type: str) -> str:
    """What a hole that says an argument's type (IS_STRING, TYPE) writes for
    a value of ``json_type`` (one of TYPE_WORDS)."""
    if hole is IS_STRING:
        return "true" if json_type == "string" else "false"
    return json_type


def json_type(value) -> str:
    """A JSON value's type, as TYPE_WORDS name it."""
    for kind, word in ((bool, "boolean"), (str, "string"), ((int, float), "number"), (dict, "object"),
                       (list, "array")):
        if isinstance(value, kind):
            return word
    return "null"


#: Kimi K3's tag tokens: ``<|open|>NAME attr="…"<|sep|>`` … ``<|close|>NAME<|sep|>``
TAG_OPEN, TAG_CLOSE, TAG_SEP = Special("<|open|>"), Special("<|close|>"), Special("<|sep|>")


def tag(name: str, close: bool = False) -> tuple[Special | Lit, ...]:
    """A Kimi K3 tag with no attributes, opening (or closing) ``name``."""
    return (TAG_CLOSE if close else TAG_OPEN, Lit(name), TAG_SEP)


@dataclass(frozen=True)
class OneOf:
    """A stretch of a call the model may spell several ways: each option
    is a sequence of parts (holes and other OneOfs among them; () is
    nothing). The first option is the template's own spelling: the one
    rendered, so the one that comes back in the next turn's prompt; the
    others are accepted and read back, never rendered."""

    options: tuple[tuple["Part", ...], ...]

    def __init__(self, *options: tuple["Part", ...]):
        object.__setattr__(self, "options", tuple(options))


Part = Special | Lit | Hole | OneOf


def spellings(parts: tuple[Part, ...]) -> tuple[tuple[Part, ...], ...]:
    """Every way to write ``parts`` with no OneOf left: each OneOf replaced
    by one of its options, the template's spelling (every first option) first."""
    out: list[tuple[Part, ...]] = [()]
    for p in parts:
        if isinstance(p, OneOf):
            out = [s + o for s in out for option in p.options for o in spellings(option)]
        else:
            out = [s + (p,) for s in out]
    return tuple(out)


def head(parts: tuple[Part, ...]) -> tuple[Special | Lit, ...]:
    """The fixed parts a spelling starts with (up to its first hole)."""
    out = []
    for p in parts:
        if not isinstance(p, (Lit, Special)):
            break
        out.append(p)
    return tuple(out)
