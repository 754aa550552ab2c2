"""The tool-call format table: how each model family writes a tool call.

Each format is a sequence of parts: special tokens (by registry role),
literal text, and three holes (the tool's NAME, its ARGS, a CALL_ID the
model writes). From these one description come the three things that must
agree byte for byte (DESIGN.md rules 5 and 6): the grammar that makes the
model write a call (chat/grammar.py), the parser that reads it back
(chat/parser.py), and the text the family's template renders for a past
call, which :func:`detect` checks by rendering a probe conversation.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Callable

from ..special_tokens import SpecialTokens

log = logging.getLogger("guided.chat")


@dataclass(frozen=True)
class Special:
    """A marker token by registry role; where the tokenizer has no such
    token (the template writes the marker as text) it is that text."""

    role: str   # a SpecialTokens role, e.g. "tool_call_start"
    text: str   # the family's marker text


def resolve(part: "Special | Lit", special: SpecialTokens | None) -> tuple[int | None, str]:
    """(token id or None, text) of a fixed part."""
    if isinstance(part, Special) and special is not None and special.id(part.role) is not None:
        tid = special.id(part.role)
        return tid, special.text(tid)
    return None, part.text


@dataclass(frozen=True)
class Lit:
    text: str


@dataclass(frozen=True)
class Hole:
    kind: str   # "name", "args" or "call_id"


NAME, ARGS, CALL_ID = Hole("name"), Hole("args"), Hole("call_id")
Part = Special | Lit | Hole

#: Mistral's template insists on ids of exactly 9 alphanumerics.
CALL_ID_PATTERN = r"[A-Za-z0-9]{9}"


@dataclass(frozen=True)
class ToolFormat:
    name: str
    call: tuple[Part, ...]
    open: tuple[Part, ...] = ()
    sep: tuple[Part, ...] = ()
    close: tuple[Part, ...] = ()
    #: "json": ARGS is the arguments object as the template's tojson writes it;
    #: "xml": one `<parameter=NAME>\nVALUE\n</parameter>\n` per argument.
    args_style: str = "json"

    @property
    def trigger(self) -> Part:
        """The first part of a call block: where the parser switches to calls."""
        return (self.open or self.call)[0]

    def render(self, calls: list[dict], special: SpecialTokens | None) -> str:
        """The text of a calls block (``calls``: name, arguments dict, id)."""
        parts = list(self.open)
        for i, _ in enumerate(calls):
            parts += ([*self.sep] if i else []) + [(p, i) for p in self.call]
        parts += list(self.close)
        out = []
        for item in parts:
            part, i = item if isinstance(item, tuple) else (item, None)
            out.append(self._render_part(part, calls[i] if i is not None else None, special))
        return "".join(out)

    def _render_part(self, part: Part, call: dict | None, special: SpecialTokens | None) -> str:
        if isinstance(part, (Lit, Special)):
            return resolve(part, special)[1]
        if part is NAME:
            return call["name"]
        if part is CALL_ID:
            return call["id"]
        return render_args(call["arguments"], self.args_style)


def render_args(arguments: dict, style: str) -> str:
    if style == "json":
        return json.dumps(arguments, ensure_ascii=False)
    return "".join(f"<parameter={k}>\n{xml_value(v)}\n</parameter>\n" for k, v in arguments.items())


def xml_value(value) -> str:
    """As Qwen3-Coder's template writes a parameter: strings raw, the rest as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


TABLE: tuple[ToolFormat, ...] = (
    # Hermes, Qwen2.5, Qwen3: JSON inside <tool_call> tokens
    ToolFormat("hermes", call=(Special("tool_call_start", "<tool_call>"), Lit('\n{"name": "'), NAME,
                               Lit('", "arguments": '), ARGS, Lit("}\n"), Special("tool_call_end", "</tool_call>")),
               sep=(Lit("\n"),)),
    # Qwen3-Coder: XML-like functions and parameters inside <tool_call> tokens
    ToolFormat("qwen3_coder", call=(Special("tool_call_start", "<tool_call>"), Lit("\n<function="), NAME, Lit(">\n"),
                                    ARGS, Lit("</function>\n"), Special("tool_call_end", "</tool_call>")),
               sep=(Lit("\n"),), args_style="xml"),
    # Mistral Nemo (v3 tokenizer): a JSON list after [TOOL_CALLS]
    ToolFormat("mistral_list", open=(Special("tool_calls_marker", "[TOOL_CALLS]"), Lit("[")),
               call=(Lit('{"name": "'), NAME, Lit('", "arguments": '), ARGS, Lit(', "id": "'),
                     CALL_ID, Lit('"}')),
               sep=(Lit(", "),), close=(Lit("]"),)),
    # Mistral Small 3.2 / Devstral (v7+): [TOOL_CALLS]name[ARGS]{...} per call
    ToolFormat("mistral_args", call=(Special("tool_calls_marker", "[TOOL_CALLS]"), NAME, Special("tool_args_marker", "[ARGS]"),
                                     ARGS)),
    # DeepSeek R1: typed calls with a fenced JSON block
    ToolFormat("deepseek_r1", open=(Special("tool_calls_begin", "<｜tool▁calls▁begin｜>"),),
               call=(Special("tool_call_begin", "<｜tool▁call▁begin｜>"), Lit("function"), Special("tool_sep", "<｜tool▁sep｜>"), NAME,
                     Lit("\n```json\n"), ARGS, Lit("\n```"), Special("tool_call_end_ds", "<｜tool▁call▁end｜>")),
               sep=(Lit("\n"),), close=(Special("tool_calls_end", "<｜tool▁calls▁end｜>"),)),
    # DeepSeek V3.1: name<sep>arguments
    ToolFormat("deepseek_v3", open=(Special("tool_calls_begin", "<｜tool▁calls▁begin｜>"),),
               call=(Special("tool_call_begin", "<｜tool▁call▁begin｜>"), NAME, Special("tool_sep", "<｜tool▁sep｜>"), ARGS,
                     Special("tool_call_end_ds", "<｜tool▁call▁end｜>")),
               close=(Special("tool_calls_end", "<｜tool▁calls▁end｜>"),)),
    # NVIDIA Nemotron (Llama 3.3 Super v1.5, Nano 2): a JSON list in <TOOLCALL> markers
    ToolFormat("nemotron", open=(Special("toolcall_list_start", "<TOOLCALL>"), Lit("[")),
               call=(Lit('{"name": "'), NAME, Lit('", "arguments": '), ARGS, Lit("}")),
               sep=(Lit(", "),), close=(Lit("]"), Special("toolcall_list_end", "</TOOLCALL>"))),
    # Liquid LFM2 (llama.cpp's JSON edit): a JSON list with ids, calls before the content
    ToolFormat("lfm2", open=(Special("tool_call_list_start", "<|tool_call_start|>"), Lit("[")),
               call=(Lit('{"name": "'), NAME, Lit('", "arguments": '), ARGS, Lit(', "id": "'),
                     CALL_ID, Lit('"}')),
               sep=(Lit(", "),), close=(Lit("]"), Special("tool_call_list_end", "<|tool_call_end|>"))),
    # Phi-4-mini (llama.cpp's edit): the function object as JSON in <|tool_call|> markers
    ToolFormat("phi4_mini", call=(Special("tool_call_marker", "<|tool_call|>"), Lit('{"name": "'), NAME,
                                  Lit('", "arguments": '), ARGS, Lit("}"),
                                  Special("tool_call_marker_end", "<|/tool_call|>"))),
    # MiniMax-M1: one JSON call per line in <tool_calls> (text markers)
    ToolFormat("minimax_m1", open=(Special("tool_calls_block_start", "<tool_calls>"), Lit("\n")),
               call=(Lit('{"name": "'), NAME, Lit('", "arguments": '), ARGS, Lit("}\n")),
               close=(Special("tool_calls_block_end", "</tool_calls>"),)),
    # Llama 3.1/3.2/3.3: the whole message is one bare JSON call
    ToolFormat("llama3_json", call=(Lit('{"name": "'), NAME, Lit('", "parameters": '), ARGS, Lit("}"))),
)

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


PROBE_CALLS = [
    {"id": "a1b2c3d4e", "name": "get_weather", "arguments": {"city": "Paris"}},
    {"id": "f5g6h7i8j", "name": "get_time", "arguments": {"zone": "UTC", "hours": 24}},
]
PROBE_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                      "parameters": {"type": "object", "properties": {
                                          "zone": {"type": "string"}, "hours": {"type": "integer"}},
                                          "required": ["zone"]}}},
]
PROBE_CONTENT = "Let me look that up."


def openai_calls(calls: list[dict]) -> list[dict]:
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]


Render = Callable[[list[dict], list[dict]], str]   # (messages, tools) → prompt text


def detect(render: Render, special: SpecialTokens) -> DetectedFormat:
    """The first format in TABLE whose rendering of the probe calls appears,
    byte for byte, in what the template renders; else the text envelope."""
    for fmt in TABLE:
        found = _probe(render, special, fmt)
        if found is not None:
            log.info("tool-call format: %s (parallel=%s)", fmt.name, found.parallel)
            return found
    log.info("tool-call format: text envelope (the template renders no known format)")
    return DetectedFormat(TEXT_ENVELOPE, parallel=True, content_sep="\n", empty_content="",
                          native=False)


def _probe(render: Render, special: SpecialTokens, fmt: ToolFormat) -> DetectedFormat | None:
    for empty in (None, ""):
        one = _rendered(render, PROBE_CALLS[:1], empty)
        if one is None or fmt.render(PROBE_CALLS[:1], special) not in one:
            continue
        two = _rendered(render, PROBE_CALLS, empty)
        parallel = two is not None and fmt.render(PROBE_CALLS, special) in two
        return DetectedFormat(fmt, parallel, _content_sep(render, special, fmt), empty)
    return None


def _content_sep(render: Render, special: SpecialTokens, fmt: ToolFormat) -> str | None:
    """The whitespace the template puts between content and the calls, if it
    keeps content at all."""
    text = _rendered(render, PROBE_CALLS[:1], PROBE_CONTENT)
    calls = fmt.render(PROBE_CALLS[:1], special)
    if text is None or PROBE_CONTENT not in text or calls not in text:
        return None
    start = text.index(PROBE_CONTENT) + len(PROBE_CONTENT)
    sep = text[start:text.index(calls, start)] if calls in text[start:] else None
    return sep if sep is not None and not sep.strip() else None


def _rendered(render: Render, calls: list[dict], content) -> str | None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": content, "tool_calls": openai_calls(calls)}]
    try:
        return render(messages, PROBE_TOOLS)
    except Exception:  # noqa: BLE001 - a template that refuses the probe just does not match
        return None
