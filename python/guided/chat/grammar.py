"""Composition of a whole assistant message (DESIGN.md rule 4):
``[reasoning] body``, where body is the client's constraint, tool calls in
the model's own format, or text. The engine allows the model's end tokens
where the grammar accepts.

The grammar starts exactly where the prompt ends: when the generation prompt
already opened a reasoning block, the grammar starts inside it; when it holds
a closed one, the grammar starts at the body. The client's constraint is a
sub-grammar of its own, never fed the reasoning.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..grammar.json_schema import json_schema_grammar
from ..grammar.lark import Expr, GrammarBuilder, alt, lit, opt, regex, regex_literal, seq, star, text_without, token
from ..special_tokens import SpecialTokens
from .message_formats import MessageFormat, text_only
from .parts import TYPE_WORDS, type_word
from .tool_formats import (ARGS, CALL_ID, INDEX, IS_STRING, NAME, TYPE, DetectedFormat, JsonArgs, Lit, OneOf, Part,
                           PyArgs, Special, XmlArgs, argument_schemas, resolve)

#: Separators of `tojson` (json.dumps defaults): templates write arguments so.
TEMPLATE_JSON = {"item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Tool:
    name: str
    schema: dict


@dataclass(frozen=True)
class ToolPlan:
    format: DetectedFormat
    tools: tuple[Tool, ...]     # the tools the model may call here
    mode: str                   # "auto", "required" (a named tool: required, one tool), "none"
    parallel: bool
    lead: str = ""              # written before the calls when no content comes first


@dataclass(frozen=True)
class ReasoningPlan:
    start: tuple[Part, ...]     # the block's markers (chat/message_formats.py)
    end: tuple[Part, ...]
    open: str
    close: str
    after: str
    state: str | None           # generation prompt: "open", "closed" or None
    mode: str                   # "optional", "required", "forbidden"
    budget: int | None = None   # tokens of reasoning text at most (kept by the engine)
    #: (inside, after): the empty block the template writes in a past turn
    #: that had no reasoning (Kimi K2's `<think></think>`); such a template
    #: gets a block on every answer, empty where reasoning is forbidden
    empty: tuple[str, str] | None = None


def compose_chat(special: SpecialTokens, *, reasoning: ReasoningPlan | None = None,
                 tools: ToolPlan | None = None, answer: dict | None = None,
                 frame: MessageFormat | None = None) -> str:
    """TopLevelGrammar JSON for one assistant message. ``answer`` is a grammar
    entry for the answer (e.g. ``{"json_schema": ...}``); ``frame``: the
    message-format row whose markers frame the answer (harmony's final
    channel before it; GigaChat's end of message after it; Kimi K3's
    response tag around it, the calls after it and the message's end)."""
    g = GrammarBuilder()
    body = _body(g, special, tools, answer, frame or _BARE)
    g.rule("start", seq(_reasoning(g, special, reasoning), body))
    return g.build()


#: an answer framed by nothing: bare text, or calls in its place
_BARE = MessageFormat("bare")


def _reasoning(g: GrammarBuilder, special: SpecialTokens, r: ReasoningPlan | None) -> Expr:
    if r is None or r.state == "closed":
        return ""
    start, end = _parts(special, r.start), _parts(special, r.end)
    close = seq(lit(r.close) if r.state == "open" and r.mode == "forbidden" else "", end, lit(r.after))
    if r.mode == "forbidden":
        if r.state is None and r.empty is not None:
            return seq(start, lit(r.empty[0]), end, lit(r.empty[1]))
        return close if r.state == "open" else ""
    # Its budget is kept by the engine (ComposedGrammar.reasoning_end), not
    # by llguidance's max_tokens, which would forbid the closing's rollback.
    # An end marker of text (Apriel's) ends the text at its first occurrence.
    end_text = text_only(r.end)
    inside = seq(g.rule("reasoning", regex(r"(?s:.*)"), suffix=end_text), lit(r.after)) if end_text else \
        seq(g.rule("reasoning", regex(r"(?s:.*)")), close)
    if r.state == "open":
        return inside
    block = seq(start, lit(r.open), inside)
    return block if r.mode == "required" or r.empty is not None else opt(block)


def _body(g: GrammarBuilder, special: SpecialTokens, tools: ToolPlan | None,
          answer: dict | None, frame: MessageFormat) -> Expr:
    opening, closing, end = (_parts(special, p) for p in (frame.answer, frame.answer_end, frame.message_end))
    if tools is None:
        return seq(opening, g.subgrammar("answer", answer) if answer else regex(r"(?s:.*)"), closing, end)
    fmt = tools.format
    # a marker token is never text; a marker of text is kept out of the text
    avoid = tuple(text for tid, text in (resolve(p, special) for p in fmt.format.triggers) if tid is None)
    if tools.mode == "none":   # no call can begin
        text = g.subgrammar("answer", answer) if answer else \
            opt(g.lexeme(text_without(*avoid, anchored=fmt.content_sep is None))) if avoid else regex(r"(?s:.*)")
        return seq(opening, text, closing, end)
    calls = _calls_block(g, special, tools)
    if frame.calls_after_answer:
        return _calls_after_answer(g, tools, answer, calls, avoid, (opening, closing, end))
    alone = calls(tools.lead)
    if tools.mode == "required":
        return alone
    anchored = fmt.content_sep is None   # text then calls is impossible: only its start matters
    text = g.subgrammar("answer", answer) if answer else \
        g.lexeme(text_without(*avoid, anchored=anchored, visible=True))   # whitespace alone is no answer
    if fmt.content_sep is None or answer:
        return alt(seq(opening, text, closing), alone)
    lead = g.lexeme(text_without(*avoid, suffix=fmt.content_sep, visible=True))
    return alt(seq(opening, text, closing), alone, seq(opening, lead, calls("")))


def _calls_after_answer(g: GrammarBuilder, tools: ToolPlan, answer: dict | None, calls: Callable[[str], Expr],
                        avoid: tuple[str, ...], frame: tuple[Expr, Expr, Expr]) -> Expr:
    """A body whose calls follow the answer's frame inside the message
    (MessageFormat.calls_after_answer, Kimi K3): ``opening TEXT answer_end
    [calls] message_end``, the answer empty before calls alone; a client's
    constrained answer, or calls alone."""
    opening, closing, end = frame
    alone = seq(closing, calls(tools.lead))
    if tools.mode == "required":
        return seq(opening, alone, end)
    text = g.subgrammar("answer", answer) if answer else \
        g.lexeme(text_without(*avoid, visible=True))   # whitespace alone is no answer
    after = opt(calls("")) if tools.format.content_sep is not None and not answer else ""
    return seq(opening, alt(seq(text, closing, after), alone), end)


def _calls_block(g: GrammarBuilder, special: SpecialTokens, plan: ToolPlan) -> Callable[[str], Expr]:
    """The calls block after a given lead (the template's whitespace before
    a call-only answer's calls). Where the block starts with text, not a
    token, lead and that text are one literal: the lexer cannot split a
    "\n" lead off an answer's text lexeme that matches it too, and would
    refuse the calls after it."""
    fmt = plan.format.format
    # each tool's arguments once, however many spellings write them
    args = [_args(g, special, fmt.args, i, t) for i, t in enumerate(plan.tools)]

    def calls(parts: tuple) -> Expr:   # a call of any tool, from ``parts`` on
        return alt(*(_call(special, t, a, fmt, parts) for t, a in zip(plan.tools, args)))
    if fmt.open:
        one = g.rule("call", calls(fmt.call))
        heads, whole = [(fmt.open[0], seq(_parts(special, fmt.open[1:]), one))], one
    else:
        # a call that may begin several ways (OneOf) is one rule per first part
        starts = _starts(fmt.call)
        heads = [(first, g.rule("call" if len(starts) == 1 else f"call_{k}", calls(rest)))
                 for k, (first, rest) in enumerate(starts)]
        whole = _either([seq(_fixed(special, first), one) for first, one in heads])
    more = star(seq(_parts(special, fmt.sep), whole)) if plan.parallel else ""
    tail = seq(more, _parts(special, fmt.close),
               lit(plan.format.end_ws) if plan.format.end_ws else _trailing(special, fmt))

    def led(lead: str) -> Expr:
        def start(first) -> Expr:
            tid, text = resolve(first, special)
            return lit(lead + text) if tid is None else seq(lit(lead) if lead else "", token(tid))
        return seq(_either([seq(start(first), rest) for first, rest in heads]), tail)
    return led


def _starts(parts: tuple) -> list[tuple[Special | Lit, tuple]]:
    """(first part, the rest) for each way ``parts`` may begin: a OneOf at
    the start stands for each of its options' beginnings."""
    if isinstance(parts[0], OneOf):
        return [s for option in parts[0].options for s in _starts(option + parts[1:])]
    return [(parts[0], parts[1:])]


def _either(exprs: list[Expr]) -> Expr:
    return exprs[0] if len(exprs) == 1 else alt(*exprs)


def _trailing(special: SpecialTokens, fmt) -> Expr:
    """Where the calls' separator begins with whitespace (Qwen's "\n"
    between </tool_call> and <tool_call>), that whitespace may also end the
    block: a real model writes "\n" after its last call, and the grammar
    must not read it as the start of another call. After it the next call's
    marker and the end token compete on the model's logits. Elsewhere
    nothing may follow the block but the end (whitespace the template does
    not write there would not come back in the next turn's prompt)."""
    sep = resolve(fmt.sep[0], special)[1] if fmt.sep and isinstance(fmt.sep[0], Lit) else ""
    ws = sep[:len(sep) - len(sep.lstrip())]
    return opt(lit(ws)) if ws and not fmt.close else ""


def _call(special: SpecialTokens, tool: Tool, args: Expr, fmt, parts: tuple) -> Expr:
    """One call of ``tool`` (``parts``: the format's call, less a first part
    the block writes; ``args``: its arguments' expression). A OneOf is any
    of its options: the model's other spellings are accepted as the
    template's own."""
    out = []
    for part in parts:
        if isinstance(part, OneOf):
            out.append(_either([_call(special, tool, args, fmt, option) for option in part.options]))
        elif part is NAME:
            out.append(lit(tool.name))
        elif part is ARGS:
            out.append(args)
        elif part is CALL_ID:
            out.append(regex(fmt.call_id))
        elif part is INDEX:
            out.append(regex(r"[0-9]{1,3}"))
        else:
            out.append(_parts(special, (part,)))
    return seq(*out)


def _parts(special: SpecialTokens, parts: tuple[Part, ...], schema: dict | None = None) -> Expr:
    """Fixed parts; a hole that says an argument's type (IS_STRING, TYPE)
    written for its ``schema``."""
    return seq(*(_type_words(p, schema or {}) if p in (IS_STRING, TYPE) else _fixed(special, p)
                 for p in parts if isinstance(p, (Special, Lit)) or p in (IS_STRING, TYPE)))


def _type_words(hole, schema: dict) -> Expr:
    """The words a type hole may write for a value of ``schema``: its one
    JSON type's; for a value the grammar writes as JSON with no one type
    (a union, no type), any type's but a string's (the value is JSON)."""
    kind = schema.get("type")
    kind = "number" if kind == "integer" else kind
    kinds = [kind] if isinstance(kind, str) and kind in TYPE_WORDS else [t for t in TYPE_WORDS if t != "string"]
    return _either([lit(w) for w in dict.fromkeys(type_word(hole, t) for t in kinds)])


def _fixed(special: SpecialTokens, part: Special | Lit) -> Expr:
    tid, text = resolve(part, special)
    return token(tid) if tid is not None else lit(text)


def tool_args_entry(schema: dict) -> dict:
    """A tool's parameters as a JSON grammar entry in the template's JSON style."""
    return json_schema_grammar(schema, "compact", TEMPLATE_JSON)


def _args(g: GrammarBuilder, special: SpecialTokens, style, index: int, tool: Tool) -> Expr:
    if isinstance(style, JsonArgs):
        return g.subgrammar(f"args_{index}", tool_args_entry(tool.schema))
    props = argument_schemas(tool.schema)
    required = set(tool.schema.get("required") or [])
    if isinstance(style, PyArgs):
        params = [(seq(lit(f"{name}="), _py_value(g, style, f"args_{index}_{j}", sub)), name in required)
                  for j, (name, sub) in enumerate(props.items())]
        return _joined(g, f"args_{index}", params, lit(", "))
    params = []
    for j, (name, sub) in enumerate(props.items()):
        params.append((seq(_parts(special, style.key_open), lit(name),
                           _parts(special, style.key_close, sub),
                           _xml_value(g, special, style, f"args_{index}_{j}", sub)),
                       name in required))
    return seq(*(p if req else opt(p) for p, req in params))


def _joined(g: GrammarBuilder, name: str, params: list[tuple[Expr, bool]], sep: Expr) -> Expr:
    """``params`` (each required or optional) in order, ``sep`` between the
    ones written: ``rest_k`` is what may follow once one was written."""
    head, rest = "", ""
    for k in range(len(params) - 1, -1, -1):
        p, req = params[k]
        after = g.rule(f"{name}_rest_{k}", rest) if rest else ""
        written = seq(sep, p, after)
        new_rest = written if req else alt(written, after or '""')   # an optional one may be left out
        head = seq(p, after) if req else alt(seq(p, after), head or '""')
        rest = new_rest
    return head or '""'


def _py_value(g: GrammarBuilder, style: PyArgs, name: str, schema: dict) -> Expr:
    """A value as a pythonic template writes it (tool_formats.PyArgs):
    numbers, objects and arrays through the JSON grammar (the same text in
    Python), booleans and None as Python's, strings quoted raw."""
    kind = schema.get("type")
    q = '"' if style.quote_all else style.quote
    if kind == "string":
        if "enum" in schema:
            inner = alt(*(lit(str(v)) for v in schema["enum"] if q not in str(v)))
        else:
            lexeme = regex(f"[^{regex_literal(q)}\\\\\\n]*")
            if "pattern" in schema:
                lexeme += " & " + regex(_raw_pattern(schema["pattern"]))
            inner = g.lexeme(lexeme + _length(schema))
        return seq(lit(q), inner, lit(q))
    if kind == "boolean":
        inner = alt(lit("True"), lit("False"))
    elif kind == "null":
        inner = lit("None")
    else:
        inner = g.subgrammar(name, tool_args_entry(schema))
    return seq(lit('"'), inner, lit('"')) if style.quote_all else inner


def _xml_value(g: GrammarBuilder, special: SpecialTokens, style: XmlArgs, name: str,
               schema: dict) -> Expr:
    """A string argument is raw text up to its closing tag (its enum,
    pattern and length kept); anything else is JSON."""
    close = _parts(special, style.value_close)
    end_tid = resolve(style.value_close[0], special)[0]
    end = "".join(resolve(p, special)[1] for p in style.value_close)
    kind = schema.get("type")
    if style.python_scalars and kind in ("boolean", "null"):
        return seq(alt(lit("True"), lit("False")) if kind == "boolean" else lit("None"), close)
    if kind != "string":
        return seq(g.subgrammar(name, tool_args_entry(schema)), close)
    if "enum" in schema:
        return seq(alt(*(lit(str(v)) for v in schema["enum"])), close)
    free = "pattern" not in schema and "minLength" not in schema and "maxLength" not in schema
    if free and end_tid is None:
        return g.rule(name, regex(r"(?s:.*)"), suffix=end)
    lexeme = regex(_raw_pattern(schema.get("pattern")))
    lexeme += _length(schema)
    if end_tid is None:
        # The parser ends a value at the first closing tag: a value that
        # held its own would be cut there and the call lost.
        lexeme += " & ~" + regex(f"(?s:.*{regex_literal(end.rstrip())}.*)")
    return seq(g.lexeme(lexeme), close)


def _length(schema: dict) -> str:
    """A string schema's minLength/maxLength as a lexeme intersection ("" if none)."""
    if "minLength" not in schema and "maxLength" not in schema:
        return ""
    lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
    return " & " + regex(f"(?s:.{{{lo},{'' if hi is None else int(hi)}}})")


def _raw_pattern(pattern: str | None) -> str:
    """A JSON Schema pattern (a search) as a whole-string regex."""
    if not pattern:
        return r"(?s:.*)"
    head = pattern[1:] if pattern.startswith("^") else r"(?s:.*)" + pattern
    return head[:-1] if head.endswith("$") and not head.endswith("\\$") else head + r"(?s:.*)"
