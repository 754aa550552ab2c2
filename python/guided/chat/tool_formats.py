"""The tool-call format table: how each model family writes a tool call.

Each format is a sequence of parts (chat/parts.py): marker tokens (spelled
here only: the registry's tool rows come from MARKERS), literal text, and
holes (the tool's NAME, its ARGS, a CALL_ID the model writes). From these one
description come the three things that must agree byte for byte (DESIGN.md
rules 5 and 6): the grammar that makes the model write a call
(chat/grammar.py), the parser that reads it back (chat/parser.py), and the
text the family's template renders for a past call, which probe.py checks
by rendering a probe conversation.

Where a family's models also write a call otherwise than its template
renders one (gpt-oss: the recipient after the channel, the analysis
channel, with or without the content type), a ``OneOf`` part lists the
spellings: the first is the template's (the one rendered, so the one that
comes back in the next turn's prompt), the others are accepted by the
grammar and read by the parser, never rendered.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from functools import cached_property
from urllib.parse import unquote

from ..special_tokens import SpecialTokens
from .parts import (ARGS, CALL_ID, INDEX, IS_STRING, NAME, TAG_OPEN, TAG_SEP, TYPE, Hole, Lit, OneOf, Part, Special,
                    json_type, resolve, spellings, tag, type_word)


@dataclass(frozen=True)
class JsonArgs:
    """The arguments object as the template's ``tojson`` writes it."""


@dataclass(frozen=True)
class XmlArgs:
    """One element per argument, ``key_open KEY key_close VALUE value_close``,
    in the order the schema lists them: a string is written raw, any other
    value as JSON (as the templates write them); with ``python_scalars``
    true, false and null as Python writes them (True, False, None: a
    template that prints a value with ``|string``)."""

    key_open: tuple[Part, ...]
    key_close: tuple[Part, ...]
    value_close: tuple[Part, ...]
    python_scalars: bool = False


@dataclass(frozen=True)
class PyArgs:
    """Python keyword arguments, ``key=VALUE, key=VALUE`` in the schema's
    order (pythonic calls). ``quote_all`` False: a string is ``quote`` + raw
    text + ``quote``, numbers, True/False/None as Python writes them, objects
    and arrays as JSON (LFM2.5). ``quote_all`` True: every value is written
    ``"`` + its text + ``"`` (Llama 4's pythonic template)."""

    quote: str = "'"
    quote_all: bool = False

    def value(self, v) -> str:
        """A value as the template writes it."""
        if self.quote_all:
            return '"' + (v if isinstance(v, str) else py_text(v)) + '"'
        return self.quote + v + self.quote if isinstance(v, str) else py_text(v)


def py_text(v) -> str:
    """``str(v)`` as Jinja's ``|string`` gives it for a JSON scalar."""
    return json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else str(v)


#: Keywords that only describe a schema: a `$ref` beside them alone is the
#: schema it points to.
_ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$comment", "deprecated"})


def argument_schemas(schema: dict) -> dict[str, dict]:
    """Each argument's schema, standing alone, for the formats that write
    one element per argument (XmlArgs, PyArgs): a `$ref` at its top is
    followed (a string argument is written raw whether its type is written
    in place or in `$defs`), and the root's `$defs`/`definitions` travel with
    it, so refs deeper inside resolve as they did in the whole schema."""
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
    out = {}
    for name, sub in (schema.get("properties") or {}).items():
        sub = sub if isinstance(sub, dict) else {}
        for _ in range(64):   # a cycle of refs is left to the JSON grammar
            target, key = _alias(schema, sub)
            if target is None:
                break
            sub = {**{k: v for k, v in sub.items() if k != key}, **target}
        own = {k: {**v, **sub[k]} for k, v in defs.items() if isinstance(sub.get(k), dict)}
        out[name] = {**defs, **sub, **own}
    return out


def _alias(root: dict, sub: dict) -> tuple[dict | None, str]:
    """(the schema ``sub`` only names, the keyword naming it): a `$ref`, or
    a one-member `allOf` (pydantic's way to describe a ref), with nothing
    but annotations beside it; (None, "") for any other schema."""
    for key in ("$ref", "allOf"):
        if key in sub and set(sub) - {key} <= _ANNOTATIONS:
            value = sub[key]
            if key == "$ref" and isinstance(value, str):
                return _pointer(root, value), key
            if key == "allOf" and isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
                return value[0], key
    return None, ""


def _pointer(root: dict, ref: str) -> dict | None:
    """The schema a local ref ("#/$defs/Unit") names in ``root``, else None."""
    if not ref.startswith("#/"):
        return None
    node = root
    for token in ref[2:].split("/"):
        key = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node if isinstance(node, dict) else None


ArgsStyle = JsonArgs | XmlArgs | PyArgs
JSON_ARGS = JsonArgs()


@dataclass(frozen=True)
class ToolFormat:
    name: str
    call: tuple[Part, ...]
    open: tuple[Part, ...] = ()
    sep: tuple[Part, ...] = ()
    close: tuple[Part, ...] = ()
    args: ArgsStyle = JSON_ARGS
    #: the ids the model writes where the call has a CALL_ID (a regex)
    call_id: str = r"[A-Za-z0-9]{9}"
    #: where the template shows a call's id built from its name and INDEX
    #: (Kimi's "functions.{name}:{index}"), the ids given to calls
    id_template: str | None = None
    #: the INDEX of a message's first call (Kimi K3 counts from 1)
    first_index: int = 0

    @cached_property
    def spellings(self) -> tuple[tuple[Part, ...], ...]:
        """The ways a call may be written (tool_formats.spellings of
        ``call``): the template's first, the only one where ``call`` has no OneOf."""
        return spellings(self.call)

    @cached_property
    def triggers(self) -> tuple[Special | Lit, ...]:
        """The first parts of a call block, one per spelling (the open part
        where the block has one): where the parser switches to calls."""
        return tuple(dict.fromkeys(self.open[:1] or tuple(s[0] for s in self.spellings)))

    def writes(self, hole: Hole) -> bool:
        """Whether a call holds ``hole`` (in any of its spellings)."""
        return any(hole in s for s in self.spellings)

    def render(self, calls: list[dict], special: SpecialTokens | None) -> str:
        """The text of a calls block (``calls``: name, arguments dict, id),
        each call in the template's own spelling."""
        return "".join(text for _, text in self._rendered(calls, special))

    def rendered_runs(self, calls: list[dict], special: SpecialTokens) -> list[int | str]:
        """The calls block as ``render`` writes it: marker tokens by id, the
        texts between them whole."""
        out: list[int | str] = []
        for tid, text in self._rendered(calls, special):
            if tid is not None:
                out.append(tid)
            elif out and isinstance(out[-1], str):
                out[-1] += text
            elif text:
                out.append(text)
        return out

    def _rendered(self, calls: list[dict], special: SpecialTokens | None) -> list[tuple[int | None, str]]:
        parts = list(self.open)
        for i, _ in enumerate(calls):
            parts += ([*self.sep] if i else []) + [(p, i) for p in self.spellings[0]]
        parts += list(self.close)
        out = []
        for item in parts:
            part, i = item if isinstance(item, tuple) else (item, None)
            out.append(self._render_part(part, calls[i] if i is not None else None, i, special))
        return out

    def _render_part(self, part: Part, call: dict | None, index: int | None,
                     special: SpecialTokens | None) -> tuple[int | None, str]:
        if isinstance(part, (Lit, Special)):
            return resolve(part, special)
        if part is NAME:
            return None, call["name"]
        if part is CALL_ID:
            return None, call["id"]
        if part is INDEX:
            return None, str(index + self.first_index)
        return None, render_args(call["arguments"], self.args, special)


def render_args(arguments: dict, style: ArgsStyle, special: SpecialTokens | None = None) -> str:
    if isinstance(style, JsonArgs):
        return json.dumps(arguments, ensure_ascii=False)
    if isinstance(style, PyArgs):
        return ", ".join(f"{k}={style.value(v)}" for k, v in arguments.items())

    def fixed(parts, value=None) -> str:
        return "".join(type_word(p, json_type(value)) if p in (IS_STRING, TYPE)
                       else resolve(p, special)[1] for p in parts)
    return "".join(
        fixed(style.key_open) + k + fixed(style.key_close, v) + xml_value(v, style) + fixed(style.value_close)
        for k, v in arguments.items())


def xml_value(value, style: XmlArgs) -> str:
    """As the XML-argument templates write a value: strings raw, the rest as
    JSON (Python's True/False/None where the style says so)."""
    if isinstance(value, str):
        return value
    if style.python_scalars and (value is None or isinstance(value, bool)):
        return str(value)
    return json.dumps(value, ensure_ascii=False)


#: Hermes' markers, which Qwen3-Coder and GLM write too; the registry also
#: answers for them by name
TOOL_CALL_START = Special("<tool_call>", "tool_call_start")
TOOL_CALL_END = Special("</tool_call>", "tool_call_end")

#: gpt-oss's channels for a call, and its content types (the template's first)
HARMONY_CHANNEL = OneOf((Lit("commentary"),), (Lit("analysis"),))
HARMONY_TYPE = OneOf((Lit(" json"),), (Lit(" "), Special("<|constrain|>"), Lit("json")), ())

TABLE: tuple[ToolFormat, ...] = (
    # Hermes, Qwen2.5, Qwen3: JSON inside <tool_call> tokens
    ToolFormat("hermes", call=(TOOL_CALL_START, Lit('\n{"name": "'), NAME, Lit('", "arguments": '), ARGS,
                               Lit("}\n"), TOOL_CALL_END),
               sep=(Lit("\n"),)),
    # Qwen3-Coder: XML-like functions and parameters inside <tool_call> tokens
    ToolFormat("qwen3_coder", call=(TOOL_CALL_START, Lit("\n<function="), NAME, Lit(">\n"),
                                    ARGS, Lit("</function>\n"), TOOL_CALL_END),
               sep=(Lit("\n"),),
               args=XmlArgs(key_open=(Lit("<parameter="),), key_close=(Lit(">\n"),),
                            value_close=(Lit("\n</parameter>\n"),))),
    # gpt-oss (harmony): one call per message to functions.NAME, ended by
    # <|call|> (an end token: the turn ends there). The template writes the
    # recipient in the header and the commentary channel, content type json;
    # the models also write the recipient after the channel, on the analysis
    # channel, the type as <|constrain|>json or none (OpenAI's harmony
    # format; llama.cpp's and vLLM's gpt-oss parsers take them all).
    ToolFormat("harmony", call=(OneOf((Lit(" to=functions."), NAME, Special("<|channel|>"), HARMONY_CHANNEL,
                                       HARMONY_TYPE),
                                      (Special("<|channel|>"), HARMONY_CHANNEL, Lit(" to=functions."), NAME,
                                       HARMONY_TYPE)),
                                Special("<|message|>"), ARGS, Special("<|call|>"))),
    # GigaChat 3: a call is a turn of its own after the answer's end of message
    ToolFormat("gigachat", call=(Special("<|message_sep|>"), Lit("\n\nfunction call"), Special("<|role_sep|>"),
                                 Lit('\n{"name": "'), NAME, Lit('", "arguments": '), ARGS, Lit("}"),
                                 Special("<|message_sep|>"))),
    # Mistral Nemo (v3 tokenizer): a JSON list after [TOOL_CALLS]
    ToolFormat("mistral_list", open=(Special("[TOOL_CALLS]"), Lit("[")),
               call=(Lit('{"name": "'), NAME, Lit('", "arguments": '), ARGS, Lit(', "id": "'),
                     CALL_ID, Lit('"}')),
               sep=(Lit(", "),), close=(Lit("]"),)),
    # Mistral Small 3.2 / Devstral (v7+): [TOOL_CALLS]name[ARGS]{...} per call
    ToolFormat("mistral_args", call=(Special("[TOOL_CALLS]"), NAME, Special("[ARGS]"), ARGS)),
    # Mistral Small 3.2 (2506): as above with the call's 9-character id, [CALL_ID]id
    ToolFormat("mistral_call_id", call=(Special("[TOOL_CALLS]"), NAME, Special("[CALL_ID]"), CALL_ID,
                                        Special("[ARGS]"), ARGS)),
    # DeepSeek R1: typed calls with a fenced JSON block
    ToolFormat("deepseek_r1", open=(Special("<｜tool▁calls▁begin｜>"),),
               call=(Special("<｜tool▁call▁begin｜>"), Lit("function"), Special("<｜tool▁sep｜>"), NAME,
                     Lit("\n```json\n"), ARGS, Lit("\n```"), Special("<｜tool▁call▁end｜>")),
               sep=(Lit("\n"),), close=(Special("<｜tool▁calls▁end｜>"),)),
    # DeepSeek V3.1: name<sep>arguments
    ToolFormat("deepseek_v3", open=(Special("<｜tool▁calls▁begin｜>"),),
               call=(Special("<｜tool▁call▁begin｜>"), NAME, Special("<｜tool▁sep｜>"), ARGS, Special("<｜tool▁call▁end｜>")),
               close=(Special("<｜tool▁calls▁end｜>"),)),
    # NVIDIA Nemotron (Llama 3.3 Super v1.5, Nano 2): a JSON list in <TOOLCALL> markers
    ToolFormat("nemotron", open=(Special("<TOOLCALL>"), Lit("[")),
               call=(Lit('{"name": "'), NAME, Lit('", "arguments": '), ARGS, Lit("}")),
               sep=(Lit(", "),), close=(Lit("]"), Special("</TOOLCALL>"))),
    # Liquid LFM2 (llama.cpp's JSON edit): a JSON list with ids, calls before the content
    ToolFormat("lfm2", open=(Special("<|tool_call_start|>"), Lit("[")),
               call=(Lit('{"name": "'), NAME, Lit('", "arguments": '), ARGS, Lit(', "id": "'),
                     CALL_ID, Lit('"}')),
               sep=(Lit(", "),), close=(Lit("]"), Special("<|tool_call_end|>"))),
    # Phi-4-mini (llama.cpp's edit): the function object as JSON in <|tool_call|> markers
    ToolFormat("phi4_mini", call=(Special("<|tool_call|>"), Lit('{"name": "'), NAME,
                                  Lit('", "arguments": '), ARGS, Lit("}"),
                                  Special("<|/tool_call|>"))),
    # MiniMax-M1: one JSON call per line in <tool_calls> (text markers)
    ToolFormat("minimax_m1", open=(Special("<tool_calls>"), Lit("\n")),
               call=(Lit('{"name": "'), NAME, Lit('", "arguments": '), ARGS, Lit("}\n")),
               close=(Special("</tool_calls>"),)),
    # GLM-4.6: <tool_call>NAME, then <arg_key>/<arg_value> pairs, one per line
    ToolFormat("glm4.6", call=(TOOL_CALL_START, NAME, Lit("\n"), ARGS, TOOL_CALL_END),
               sep=(Lit("\n"),),
               args=XmlArgs(key_open=(Special("<arg_key>"),),
                            key_close=(Special("</arg_key>"), Lit("\n"), Special("<arg_value>")),
                            value_close=(Special("</arg_value>"), Lit("\n")))),
    # GLM-4.5 (llama.cpp's edit): as GLM-4.6 with no newline after the name or a value
    ToolFormat("glm4.5", call=(TOOL_CALL_START, NAME, ARGS, TOOL_CALL_END),
               sep=(Lit("\n"),),
               args=XmlArgs(key_open=(Special("<arg_key>"),),
                            key_close=(Special("</arg_key>"), Lit("\n"), Special("<arg_value>")),
                            value_close=(Special("</arg_value>"),))),
    # MiniMax-M2: <invoke name=…> with <parameter name=…> elements
    ToolFormat("minimax_m2", open=(Special("<minimax:tool_call>"), Lit("\n")),
               call=(Lit('<invoke name="'), NAME, Lit('">\n'), ARGS, Lit("</invoke>\n")),
               close=(Special("</minimax:tool_call>"),),
               args=XmlArgs(key_open=(Lit('<parameter name="'),), key_close=(Lit('">'),),
                            value_close=(Lit("</parameter>\n"),))),
    # ByteDance Seed-OSS: Qwen3-Coder-like functions in <seed:tool_call>, values unpadded
    ToolFormat("seed_oss", call=(Special("<seed:tool_call>"), Lit("\n<function="), NAME,
                                 Lit(">\n"), ARGS, Lit("</function>\n"),
                                 Special("</seed:tool_call>")),
               sep=(Lit("\n"),),
               args=XmlArgs(key_open=(Lit("<parameter="),), key_close=(Lit(">"),),
                            value_close=(Lit("</parameter>\n"),))),
    # DeepSeek-V3.2: DSML invoke/parameter tags, each parameter typed string="true|false"
    ToolFormat("deepseek_v3.2", open=(Lit("<｜DSML｜function_calls>\n"),),
               call=(Lit('<｜DSML｜invoke name="'), NAME, Lit('">\n'), ARGS, Lit("</｜DSML｜invoke>\n")),
               close=(Lit("</｜DSML｜function_calls>"),),
               # the template joins parameters with "\n" and ends the last with
               # one: the same bytes as a "\n" after each (a tool with no
               # arguments gets one "\n" where the template writes two)
               args=XmlArgs(key_open=(Lit('<｜DSML｜parameter name="'),),
                            key_close=(Lit('" string="'), IS_STRING, Lit('">')),
                            value_close=(Lit("</｜DSML｜parameter>\n"),))),
    # Kimi K2 (Thinking): a section of calls, each id "functions.NAME:IDX"
    ToolFormat("kimi_k2", open=(Special("<|tool_calls_section_begin|>"),),
               call=(Special("<|tool_call_begin|>"), Lit("functions."), NAME, Lit(":"), INDEX,
                     Special("<|tool_call_argument_begin|>"), ARGS, Special("<|tool_call_end|>")),
               close=(Special("<|tool_calls_section_end|>"),),
               id_template="functions.{name}:{index}"),
    # Kimi K3: tag tokens, a tools tag after the answer's response tag (message_formats.KIMI_K3),
    # one argument tag per argument with its JSON type, calls counted from 1
    ToolFormat("kimi_k3", open=tag("tools"),
               call=(TAG_OPEN, Lit('call tool="'), NAME, Lit('" index="'), INDEX, Lit('"'), TAG_SEP, ARGS,
                     *tag("call", close=True)),
               close=tag("tools", close=True), first_index=1,
               args=XmlArgs(key_open=(TAG_OPEN, Lit('argument key="')),
                            key_close=(Lit('" type="'), TYPE, Lit('"'), TAG_SEP),
                            value_close=tag("argument", close=True))),
    # InternLM2: <|action_start|><|plugin|> and the function object as JSON
    ToolFormat("internlm2", call=(Special("<|action_start|>"), Special("<|plugin|>"),
                                  Lit('\n{"name": "'), NAME, Lit('", "arguments": '), ARGS, Lit("}"),
                                  Special("<|action_end|>"))),
    # IBM Granite 3: one "<|tool_call|> {…}" line per call
    ToolFormat("granite", call=(Special("<|tool_call|>"), Lit(' {"name": "'), NAME,
                                Lit('", "arguments": '), ARGS, Lit("}\n"))),
    # Cohere Command R7B: an indented JSON list of actions with running indices
    ToolFormat("command_r7b", open=(Special("<|START_ACTION|>"), Lit("[\n    ")),
               call=(Lit('{"tool_call_id": "'), INDEX, Lit('", "tool_name": "'), NAME,
                     Lit('", "parameters": '), ARGS, Lit("}")),
               sep=(Lit(",\n    "),), close=(Lit("\n]"), Special("<|END_ACTION|>"))),
    # Mistral 7B v0.3 (vLLM's parallel template): a space after [TOOL_CALLS]
    ToolFormat("mistral_list_space", open=(Special("[TOOL_CALLS]"), Lit(" [")),
               call=(Lit('{"name": "'), NAME, Lit('", "arguments": '), ARGS, Lit(', "id": "'),
                     CALL_ID, Lit('"}')),
               sep=(Lit(", "),), close=(Lit("]"),)),
    # Hunyuan-A13B, Apriel: a JSON list in <tool_calls> (text markers)
    ToolFormat("tool_calls_list", open=(Special("<tool_calls>"), Lit("[")),
               call=(Lit('{"name": "'), NAME, Lit('", "arguments": '), ARGS, Lit("}")),
               sep=(Lit(", "),), close=(Lit("]"), Special("</tool_calls>"))),
    # Salesforce xLAM: the message is a bare JSON list of calls
    ToolFormat("xlam", open=(Lit('[{"name": "'),),
               call=(NAME, Lit('", "arguments": '), ARGS, Lit("}")),
               sep=(Lit(', {"name": "'),), close=(Lit("]"),)),
    # Liquid LFM2.5: a Python list of calls, strings in single quotes
    ToolFormat("pythonic_lfm", open=(Special("<|tool_call_start|>"), Lit("[")),
               call=(NAME, Lit("("), ARGS, Lit(")")), sep=(Lit(", "),),
               close=(Lit("]"), Special("<|tool_call_end|>")), args=PyArgs("'")),
    # Llama 4 (vLLM's pythonic template): a Python list of calls, every value in double quotes
    ToolFormat("pythonic_quoted", open=(Lit("["),), call=(NAME, Lit("("), ARGS, Lit(")")), sep=(Lit(", "),),
               close=(Lit("]"),), args=PyArgs('"', quote_all=True)),
    # Llama 3.1/3.2/3.3: the whole message is one bare JSON call
    ToolFormat("llama3_json", call=(Lit('{"name": "'), NAME, Lit('", "parameters": '), ARGS, Lit("}"))),
    # Phi-4-mini (vLLM's template): bare function objects joined by "," (last:
    # every row above holds this text inside its markers)
    ToolFormat("json_objects", call=(Lit('{"name": "'), NAME, Lit('", "arguments": '), ARGS, Lit("}")),
               sep=(Lit(","),)),
)


def specials(fmt: ToolFormat) -> tuple[Special, ...]:
    """The markers a format writes (in any spelling), its arguments' included."""
    args = (*fmt.args.key_open, *fmt.args.key_close, *fmt.args.value_close) if isinstance(fmt.args, XmlArgs) else ()
    calls = (p for s in fmt.spellings for p in s)
    return tuple(dict.fromkeys(p for p in (*fmt.open, *calls, *fmt.sep, *fmt.close, *args) if isinstance(p, Special)))


#: Every marker the table writes, once.
MARKERS: tuple[Special, ...] = tuple(dict.fromkeys(p for fmt in TABLE for p in specials(fmt)))

#: For templates and tokenizers with no tool support: the envelope is plain
#: text, tools are described in a system message and past calls are written
#: into the assistant's content by us (chat/prompt.py).
TEXT_ENVELOPE = ToolFormat(
    "text_envelope", call=(Lit('<tool_call>\n{"name": "'), NAME, Lit('", "arguments": '), ARGS,
                           Lit("}\n</tool_call>")),
    sep=(Lit("\n"),))


@dataclass(frozen=True)
class DetectedFormat:
    """A format as one template uses it."""

    format: ToolFormat
    parallel: bool              # the template renders several calls in one message
    content_sep: str | None     # between content and the calls; None: content is dropped
    empty_content: str | None   # what a call-only message carries as content (None or "")
    native: bool = True         # False: the text envelope, rendered by us
    #: the whitespace the template writes right before the calls of a
    #: call-only turn ("\n" after Apriel's and Granite's role headers, after
    #: GLM's closed reasoning block)
    call_ws: str = ""
    #: the whitespace the template writes between the calls and its end of
    #: turn ("\n" before Apriel's <|end|>)
    end_ws: str = ""
    #: the ids the engine gives calls whose format has no CALL_ID: "openai"
    #: (`call_…`), or "alnum9" where the template demands 9 alphanumerics
    id_style: str = "openai"

    def new_call_id(self, prefix: str, index: int) -> str:
        """The id of call ``index`` of a message the model wrote without ids
        (``prefix``: random hex, one per message)."""
        return uuid.uuid4().hex[:9] if self.id_style == "alnum9" else f"call_{prefix}{index}"
