"""Reading a calls block (its text so far) against a tool format's parts
(tool_formats.py): the calls it holds, each whole or cut where the text
ends, and whether the text can still be a block of that format. The chat
parser (parser.py) reads the block again as each step's tokens arrive,
from where the last read left off (ReadState): a step costs what it adds,
not what the block holds so far."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..special_tokens import SpecialTokens
from .parts import TYPE, TYPE_WORDS, head, type_word
from .tool_formats import (ARGS, CALL_ID, INDEX, IS_STRING, NAME, DetectedFormat, JsonArgs, Lit,
                           PyArgs, Special, XmlArgs, argument_schemas, resolve)

_DECODER = json.JSONDecoder()


@dataclass
class ParsedCall:
    name: str | None = None
    call_id: str | None = None
    index: str | None = None  # the INDEX the model wrote, where the format has one
    args: str = ""            # the arguments JSON text so far
    done: bool = False
    spelling: int = 0         # which of the format's spellings (0: the template's own)


@dataclass
class ReadState:
    """Where the next read of a growing calls block starts. The text only
    grows and a whole call never changes, so a read starts after the last
    whole call; inside the call being written it resumes the JSON scan or the
    XML arguments where they stopped."""

    opened: bool = False                  # the block's open parts are read
    pos: int = 0                          # after the open parts / the last whole call
    done: list[ParsedCall] = field(default_factory=list)
    json: "_JsonScan | None" = None       # the JSON arguments being written
    xml: "_XmlRead | None" = None         # the XML arguments being written
    arguments: dict[str, dict] = field(default_factory=dict)   # per tool: argument_schemas, once

    def argument_schemas(self, name: str, schemas: dict[str, dict]) -> dict[str, dict]:
        if name not in self.arguments:
            self.arguments[name] = argument_schemas(schemas.get(name) or {})
        return self.arguments[name]


def parse_calls(text: str, fmt: DetectedFormat, schemas: dict[str, dict],
                special: SpecialTokens, state: ReadState | None = None) -> tuple[list[ParsedCall], bool]:
    """The calls in a (possibly unfinished) calls block; ok is False when the
    text cannot be a prefix of a block of this format. ``state``: the last
    read of the same block with less text (updated here)."""
    f = fmt.format
    state = ReadState() if state is None else state
    cur = _Cursor(text, special, state)
    if not state.opened:
        if not cur.parts(f.open):
            return [], cur.ok
        state.opened, state.pos = True, cur.pos
    calls = list(state.done)
    while True:
        if calls:   # after a whole call: another, or the close
            if cur.at_end() or (not f.close and cur.rest_is_space()):
                # whitespace after the last call (the grammar's trailing
                # whitespace), or a separator whose call has not begun
                return calls, True
            nexts = (f.sep,) if f.sep else tuple(head(s) for s in f.spellings)
            if not any(cur.peek(p) for p in nexts) or not cur.parts(f.sep):
                break
        call = ParsedCall()
        calls.append(call)
        if not _parse_call(cur, f, call, schemas):
            return calls, cur.ok
        state.done, state.pos = list(calls), cur.pos
    cur.parts(f.close)
    return calls, cur.ok


def _parse_call(cur: "_Cursor", f, call: ParsedCall, schemas: dict[str, dict]) -> bool:
    """One call, in whichever of the format's spellings the text is (the
    template's first): True once it is whole; False while it may still
    become one (``call`` then holds what the first spelling that fits has
    read so far), or with ``cur.ok`` False where no spelling fits."""
    start, cut = cur.pos, None
    for k, parts in enumerate(f.spellings):
        cur.pos, cur.ok, read = start, True, ParsedCall(spelling=k)
        if _parse_spelling(cur, f, parts, read, schemas):
            vars(call).update(vars(read))
            return True
        if cur.ok and cut is None:
            cut = (read, cur.pos)
    if cut is None:
        cur.pos, cur.ok = start, False
        return False
    vars(call).update(vars(cut[0]))
    cur.pos, cur.ok = cut[1], True
    return False


def _parse_spelling(cur: "_Cursor", f, parts: tuple, call: ParsedCall, schemas: dict[str, dict]) -> bool:
    for k, part in enumerate(parts):
        if part is NAME:
            call.name = cur.name(schemas, cur.after(parts, k, f.args))
            if call.name is None:
                return False
        elif part is CALL_ID:
            call.call_id = cur.regex(f.call_id)
            if call.call_id is None:
                return False
        elif part is INDEX:
            call.index = cur.regex(r"[0-9]{1,3}")
            if call.index is None or cur.at_end():   # more digits may follow
                call.index = None
                return False
        elif part is ARGS:
            nxt = cur.render(parts[k + 1]) if k + 1 < len(parts) else ""
            if isinstance(f.args, JsonArgs):
                if not cur.json_args(call):
                    return False
            elif isinstance(f.args, PyArgs):
                if not cur.py_args(call, f.args, schemas, nxt):
                    return False
            elif not cur.xml_args(call, f.args, schemas, nxt):
                return False
        elif not cur.parts((part,)):
            return False
    call.done = True
    return True


class _Cursor:
    """Reads a calls block left to right; stops (ok stays True) where the
    text ends before a part is complete, fails (ok False) on a mismatch."""

    def __init__(self, text: str, special: SpecialTokens, state: ReadState):
        self.text, self.pos, self.ok, self.special, self.state = text, state.pos, True, special, state

    def render(self, part) -> str:
        return resolve(part, self.special)[1] if isinstance(part, (Lit, Special)) else ""

    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def rest_is_space(self) -> bool:
        return not self.text[self.pos:].strip()

    def peek(self, parts) -> bool:
        want = "".join(self.render(p) for p in parts if isinstance(p, (Lit, Special)))
        return bool(want) and self.text.startswith(want, self.pos)

    def expect(self, want: str) -> bool:
        if self.text.startswith(want, self.pos):
            self.pos += len(want)
            return True
        if not want.startswith(self.text[self.pos:self.pos + len(want)]):
            self.ok = False
        return False

    def parts(self, parts) -> bool:
        return all(self.expect(self.render(p)) for p in parts if isinstance(p, (Lit, Special)))

    def after(self, parts, k: int, style) -> tuple[str, ...]:
        """The texts that may come right after ``parts[k]``: the next fixed
        part's; before XML arguments, the first one's opening or, where there
        are none, what follows them; before JSON arguments, the brace; ""
        before another hole or at the call's end."""
        nxt = parts[k + 1] if k + 1 < len(parts) else None
        if nxt is ARGS and isinstance(style, XmlArgs):
            return (self.fixed(style.key_open), *self.after(parts, k + 1, style))
        if nxt is ARGS and isinstance(style, JsonArgs):
            return ("{",)
        return (self.render(nxt),)

    def name(self, schemas: dict[str, dict], after: tuple[str, ...]) -> str | None:
        """The declared tool name written here, once the text shows it is
        that one and no other: the names that fit the text so far (each
        followed by one of the texts ``after`` it) are one, written whole, or
        are all written with what follows them (then the longest, the name
        the model wrote). While a name may still go on (``…_badge`` when
        ``…_badge1`` is declared too) None, with ok True: the name is not
        known yet; ok False when no declared name fits."""
        rest = self.text[self.pos:self.pos + max(map(len, schemas), default=0) + max(map(len, after))]
        fits = [n for n in schemas if any((n + a).startswith(rest) or rest.startswith(n + a) for a in after)]
        if not fits:
            self.ok = False
            return None
        whole = [n for n in fits if any(rest.startswith(n + a) for a in after)] if len(fits) > 1 \
            else [n for n in fits if rest.startswith(n)]
        if len(whole) < len(fits):
            return None
        name = max(whole, key=len)
        self.pos += len(name)
        return name

    def regex(self, pattern: str) -> str | None:
        m = re.compile(pattern).match(self.text, self.pos)
        if m is None:
            return None
        self.pos = m.end()
        return m.group(0)

    def json_args(self, call: ParsedCall) -> bool:
        scan = self.state.json
        if scan is None or scan.start != self.pos:
            scan = self.state.json = _JsonScan(self.pos)
        scan.end_in(self.text)
        if scan.first not in (None, "{"):
            self.ok = False   # arguments that are no object: not a call of this format
            return False
        try:
            if scan.end is None or scan.failed:
                raise json.JSONDecodeError("open", self.text, self.pos)
            value, end = _DECODER.raw_decode(self.text, self.pos)
        except json.JSONDecodeError:
            scan.failed = scan.end is not None
            call.args = self.text[self.pos:]
            return False
        call.args = self.text[self.pos:end]
        self.pos = end
        return True

    def xml_args(self, call: ParsedCall, style, schemas: dict[str, dict], nxt: str) -> bool:
        """XML arguments (tool_formats.XmlArgs) into ``call.args`` as JSON,
        once they are whole: False while the text ends inside them."""
        props = self.state.argument_schemas(call.name, schemas)
        key_open, value_close = self.fixed(style.key_open), self.fixed(style.value_close)
        close_head = self.render(style.key_close[0]) if style.key_close else ""
        read = self.state.xml
        if read is None or read.start != self.pos:
            read = self.state.xml = _XmlRead(self.pos)
        self.pos, values = read.pos, read.values
        while True:
            if not self.text.startswith(key_open, self.pos):
                rest = self.text[self.pos:self.pos + len(key_open)]
                if key_open.startswith(rest) and rest or (not rest and nxt):
                    return False   # cut before the next part: which one is not known yet
                break
            head = self.pos + len(key_open)
            end_name = self.text.find(close_head, head) if close_head else head
            if end_name < 0:
                return False
            name, is_string = self.text[head:end_name], None
            self.pos = end_name
            for part in style.key_close:
                if part in (IS_STRING, TYPE):   # the words that say the value's type
                    word = self.regex("|".join(dict.fromkeys(type_word(part, t) for t in TYPE_WORDS)))
                    if word is None:
                        return False
                    is_string = word == type_word(part, "string")
                elif not self.expect(self.render(part)):
                    return False
            tail = self.text.find(value_close, max(self.pos, read.searched - len(value_close) + 1))
            if tail < 0:
                read.searched = len(self.text)   # the value so far holds no closing tag
                return False
            raw = self.text[self.pos:tail]
            values[name] = raw if is_string else _xml_typed(raw, props.get(name) or {}, style) \
                if is_string is None else _json_or_raw(raw)
            self.pos = read.pos = read.searched = tail + len(value_close)
        call.args = json.dumps(values, ensure_ascii=False)
        return True

    def py_args(self, call: ParsedCall, style: PyArgs, schemas: dict[str, dict], nxt: str) -> bool:
        """Python keyword arguments (tool_formats.PyArgs) into ``call.args``
        as JSON, once they are whole: False while the text ends inside them."""
        props = self.state.argument_schemas(call.name, schemas)
        values = {}
        while not self.text.startswith(nxt, self.pos):
            if values and not self.expect(", "):
                return False
            eq = self.text.find("=", self.pos)
            if eq < 0:
                return False
            name = self.text[self.pos:eq]
            self.pos = eq + 1
            value = self._py_value(style, props.get(name) or {})
            if value is _CUT:
                return False
            values[name] = value
        call.args = json.dumps(values, ensure_ascii=False)
        return True

    def _py_value(self, style: PyArgs, schema: dict):
        kind = schema.get("type")
        quoted = style.quote_all or (kind == "string" or self.text.startswith(style.quote, self.pos))
        if quoted and kind not in ("object", "array"):
            q = '"' if style.quote_all else style.quote
            if not self.expect(q):
                return _CUT
            end = self.text.find(q, self.pos)
            if end < 0:
                return _CUT
            raw, self.pos = self.text[self.pos:end], end + 1
            return raw if kind == "string" else _py_scalar(raw)
        if style.quote_all and not self.expect('"'):
            return _CUT
        if self.text.startswith(("{", "["), self.pos):
            try:
                value, self.pos = _DECODER.raw_decode(self.text, self.pos)
            except json.JSONDecodeError:
                return _CUT
        else:
            m = re.compile(r"[^,)\"]*").match(self.text, self.pos)
            if m.end() >= len(self.text):
                return _CUT   # the value may go on
            value, self.pos = _py_scalar(m.group(0)), m.end()
        if style.quote_all and not self.expect('"'):
            return _CUT
        return value

    def fixed(self, parts) -> str:
        return "".join(self.render(p) for p in parts)


_CUT = object()   # a value the text ends inside


class _JsonScan:
    """Where the JSON object that starts at ``start`` ends (after its
    closing brace), found reading each character once however often the
    growing text is read: ``end`` stays None while it is open, or when the
    value is no object (``first``, its first character, says)."""

    def __init__(self, start: int):
        self.start = self.upto = start
        self.first: str | None = None
        self.depth, self.in_string, self.escape = 0, False, False
        self.end: int | None = None
        self.failed = False   # the decoder refused it: more text cannot mend that

    def end_in(self, text: str) -> int | None:
        i, n = self.upto, len(text)
        while self.end is None and self.first in (None, "{") and i < n:
            c = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.end = i + 1
            if self.first is None and not c.isspace():
                self.first = c
            i += 1
        self.upto = i
        return self.end


@dataclass
class _XmlRead:
    """The XML arguments that start at ``start``, read up to ``pos``."""

    start: int
    pos: int = -1
    values: dict = field(default_factory=dict)
    searched: int = 0    # the current value holds no closing tag before this

    def __post_init__(self):
        self.pos = self.start


def _py_scalar(raw: str):
    """A Python scalar as a template writes it (True, None, 24, 1.5)."""
    return {"True": True, "False": False, "None": None}.get(raw, _json_or_raw(raw))


def _xml_typed(raw: str, schema: dict, style):
    if schema.get("type") == "string":
        return raw
    return _py_scalar(raw) if style.python_scalars else _json_or_raw(raw)


def _json_or_raw(raw: str):
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw
