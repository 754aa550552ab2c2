"""Which row of the tool-format table (tool_formats.py) a template uses,
and how: render a probe conversation through it and find each row's
rendering of the probe's calls in the text, byte for byte; then the
template's contract around the calls (content beside them, what a call-only
turn's content must be, ids it demands, whitespace before and after them,
how it prints a boolean)."""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable

from ..special_tokens import SpecialTokens
from .tool_formats import CALL_ID, TABLE, TEXT_ENVELOPE, DetectedFormat, ToolFormat, XmlArgs

log = logging.getLogger("guided.chat")


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


def detect(render: Render, special: SpecialTokens, before_calls: str = "") -> DetectedFormat:
    """The first format in TABLE whose rendering of the probe calls appears,
    byte for byte, in what the template renders; else the text envelope.
    ``before_calls``: what the message format writes between an answer and
    calls that follow it (Kimi K3's response tag closed), no separator."""
    for fmt in TABLE:
        found = _probe(render, special, fmt, before_calls)
        if found is not None:
            log.info("tool-call format: %s (parallel=%s)", fmt.name, found.parallel)
            return found
    log.info("tool-call format: text envelope (the template renders no known format)")
    return DetectedFormat(TEXT_ENVELOPE, parallel=True, content_sep="\n", empty_content="",
                          native=False, id_style=_id_style(render, TEXT_ENVELOPE, ""))


def probe_calls(fmt: ToolFormat) -> list[dict]:
    """The probe's calls, with ids in the format's shape where it has one."""
    if fmt.id_template is None:
        return PROBE_CALLS
    return [{**c, "id": fmt.id_template.format(name=c["name"], index=i)} for i, c in enumerate(PROBE_CALLS)]


def _probe(render: Render, special: SpecialTokens, fmt: ToolFormat, before_calls: str) -> DetectedFormat | None:
    calls = probe_calls(fmt)
    block = fmt.render(calls[:1], special)
    found = {empty: text for empty in (None, "")
             if (text := _rendered(render, calls[:1], empty)) is not None and block in text}
    if not found:
        return None
    empty = _empty_content(render, calls[:1], found)
    one = found[empty]
    two = _rendered(render, calls, empty)
    parallel = two is not None and fmt.render(calls, special) in two
    before, after = one[:one.index(block)], one[one.index(block) + len(block):]
    ws = after[:len(after) - len(after.lstrip())]
    ends = [special.text(t) for t in special.end_ids] if special is not None else []
    return DetectedFormat(_scalars(render, special, fmt, empty), parallel,
                          _content_sep(render, special, fmt, before_calls),
                          empty, call_ws=before[len(before.rstrip()):], id_style=_id_style(render, fmt, empty),
                          end_ws=ws if after[len(ws):].startswith(tuple(ends)) and ends else "")


def _empty_content(render: Render, calls: list[dict], found: dict) -> str | None:
    """What a call-only message carries as content: None, as OpenAI clients
    send it, where the template takes it; "" where it prints "None" (GLM,
    MiniMax-M2) or fails on None in a past turn but not on "" (QwQ-32B's
    `message.content.split('</think>')` runs on every past assistant turn,
    not on the last: llama.cpp's requires_non_null_content)."""
    if None not in found or ("" in found and found[None] != found[""]):
        return ""
    for messages in _past_call_turns(calls):
        if not _takes(render, messages(None)) and _takes(render, messages("")):
            return ""
    return None


def _past_call_turns(calls: list[dict]) -> list[Callable[[str | None], list[dict]]]:
    """Conversations in which the call turn is a past turn: answered by its
    results, and also before a later user message (the branch for turns
    before the last query, Qwen3's)."""
    def answered(content):
        return [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": content, "tool_calls": openai_calls(calls)},
                *({"role": "tool", "tool_call_id": c["id"], "content": "Sunny"} for c in calls)]

    def asked_again(content):
        return [*answered(content), {"role": "assistant", "content": "It is sunny."},
                {"role": "user", "content": "And in Rome?"}]
    return [answered, asked_again]


def _takes(render: Render, messages: list[dict]) -> bool:
    try:
        render(messages, PROBE_TOOLS)
        return True
    except Exception:  # noqa: BLE001 - the template's refusal is the answer
        return False


def _scalars(render: Render, special: SpecialTokens, fmt: ToolFormat, empty) -> ToolFormat:
    """``fmt`` with XmlArgs.python_scalars where the template prints a
    boolean as Python does (`|string`: Qwen3-Coder, Seed-OSS), not as JSON."""
    if not isinstance(fmt.args, XmlArgs):
        return fmt
    calls = [{**probe_calls(fmt)[0], "arguments": {"city": "Paris", "exact": True}}]
    text = _rendered(render, calls, empty) or ""
    python = replace(fmt, args=replace(fmt.args, python_scalars=True))
    return python if python.render(calls, special) in text and fmt.render(calls, special) not in text else fmt


def _id_style(render: Render, fmt: ToolFormat, empty) -> str:
    """"alnum9" where the template refuses OpenAI-style ids in a tool-call
    round trip (Mistral's "Tool call IDs should be alphanumeric strings with
    length 9!") but takes 9 alphanumerics; else "openai". The text envelope
    is probed too: its calls are content, but the results keep their ids."""
    if fmt.writes(CALL_ID) or fmt.id_template:
        return "openai"   # the model writes the ids, in the template's shape

    def round_trip(call_id: str) -> bool:
        call = {**PROBE_CALLS[0], "id": call_id}
        said = {"content": fmt.render([call], None)} if fmt is TEXT_ENVELOPE else \
            {"content": empty, "tool_calls": openai_calls([call])}
        messages = [{"role": "user", "content": "What is the weather in Paris?"},
                    {"role": "assistant", **said},
                    {"role": "tool", "tool_call_id": call_id, "content": "Sunny"}]
        return _takes(render, messages)
    if round_trip("call_" + "0123456789abcdef" + "0") or not round_trip(PROBE_CALLS[0]["id"]):
        return "openai"
    return "alnum9"


def _content_sep(render: Render, special: SpecialTokens, fmt: ToolFormat, before_calls: str) -> str | None:
    """The whitespace the template puts between content and the calls (after
    ``before_calls``), if it keeps content at all."""
    text = _rendered(render, probe_calls(fmt)[:1], PROBE_CONTENT)
    calls = fmt.render(probe_calls(fmt)[:1], special)
    if text is None or PROBE_CONTENT + before_calls not in text or calls not in text:
        return None
    start = text.index(PROBE_CONTENT + before_calls) + len(PROBE_CONTENT + before_calls)
    sep = text[start:text.index(calls, start)] if calls in text[start:] else None
    return sep if sep is not None and not sep.strip() else None


def _rendered(render: Render, calls: list[dict], content) -> str | None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": content, "tool_calls": openai_calls(calls)}]
    try:
        return render(messages, PROBE_TOOLS)
    except Exception:  # noqa: BLE001 - a template that refuses the probe just does not match
        return None
