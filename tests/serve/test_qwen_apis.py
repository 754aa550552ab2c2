"""Tool choices over the three HTTP APIs on a real tool-calling model
(Qwen2.5-Coder-0.5B-Instruct, conftest's ``qwen_gguf``), with the official
clients: Chat Completions, Responses and Anthropic's Messages each ask for
required, a named tool, auto, none, one call only (parallel_tool_calls false,
Messages' disable_parallel_tool_use) and, where the API has it,
allowed_tools; what comes back validates and keeps to the field. Streams
add up to the whole answer. The server runs with its defaults (the grammar
for "auto" on). All requests of a test go out at once: one batch."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers.live_server import sdk_clients
from helpers.real_tools import ONE_CALL, TOOLS, TWO_CITIES, assert_valid

ALLOWED = ("get_weather", "search_flights")
FLAT = [{"type": "function", **t["function"]} for t in TOOLS]                  # Responses' tools
CLAUDE = [{"name": t["function"]["name"], "description": t["function"]["description"],
           "input_schema": t["function"]["parameters"]} for t in TOOLS]       # Messages' tools
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def qwen_server(qwen_gguf):
    """(openai client, anthropic client, model id)."""
    with sdk_clients(qwen_gguf, "--max-num-seqs", "32") as clients:
        yield clients


def _at_once(calls: dict) -> dict:
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {k: pool.submit(f) for k, f in calls.items()}
        return {k: f.result() for k, f in futures.items()}


def _chat_calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_chat_completions(qwen_server):
    client, _, model = qwen_server

    def chat(question, **kw):
        return lambda: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], tools=TOOLS, max_tokens=128,
            **GREEDY, **kw).choices[0]
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": n}} for n in ALLOWED]}}
    got = _at_once({
        "required": chat(ONE_CALL[0], tool_choice="required"),
        "named": chat(ONE_CALL[1], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        "auto": chat("Say hello to me in French.", tool_choice="auto"),
        "none": chat(ONE_CALL[3], tool_choice="none"),
        "one": chat(TWO_CITIES, tool_choice="required", parallel_tool_calls=False),
        "allowed": chat(ONE_CALL[3], tool_choice=allowed),
        "streamed": lambda: list(client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": ONE_CALL[0]}], tools=TOOLS, max_tokens=128,
            tool_choice="required", stream=True, **GREEDY)),
    })
    for kind in ("required", "named", "one", "allowed"):
        calls = _chat_calls(got[kind].message)
        assert calls and got[kind].finish_reason == "tool_calls", (kind, got[kind])
        for name, args in calls:
            assert_valid(name, args, {"named": ("get_weather",), "allowed": ALLOWED}.get(kind, ALLOWED + (
                "calculate_triangle_area", "convert_currency", "send_email")))
    assert len(_chat_calls(got["required"].message)) == 1 and len(_chat_calls(got["one"].message)) == 1
    for kind in ("auto", "none"):
        assert not got[kind].message.tool_calls and got[kind].message.content, (kind, got[kind])
        assert got[kind].finish_reason == "stop"

    # the stream adds up to the whole answer
    calls, finish = {}, None
    for chunk in got["streamed"]:
        for c in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(c.index, ["", ""])
            entry[0] += c.function.name or "" if c.function else ""
            entry[1] += c.function.arguments or "" if c.function else ""
        finish = chunk.choices[0].finish_reason or finish
    whole = _chat_calls(got["required"].message)
    assert [tuple(v) for _, v in sorted(calls.items())] == whole and finish == "tool_calls"


def test_responses(qwen_server):
    client, _, model = qwen_server

    def respond(question, **kw):
        return lambda: client.responses.create(model=model, input=question, tools=FLAT, max_output_tokens=128,
                                               **GREEDY, **kw)
    got = _at_once({
        "required": respond(ONE_CALL[0], tool_choice="required"),
        "named": respond(ONE_CALL[1], tool_choice={"type": "function", "name": "get_weather"}),
        "none": respond(ONE_CALL[3], tool_choice="none"),
        "one": respond(TWO_CITIES, tool_choice="required", parallel_tool_calls=False),
        "allowed": respond(ONE_CALL[3], tool_choice={"type": "allowed_tools", "mode": "required", "tools": [
            {"type": "function", "name": n} for n in ALLOWED]}),
    })
    for kind, r in got.items():
        calls = [(o.name, o.arguments) for o in r.output if o.type == "function_call"]
        if kind == "none":
            assert not calls and r.output_text, r.output
            continue
        assert len(calls) == 1, (kind, r.output)
        assert_valid(*calls[0], {"named": ("get_weather",), "allowed": ALLOWED}.get(kind, tuple(
            t["name"] for t in FLAT)))


def test_messages(qwen_server):
    _, claude, model = qwen_server

    def message(question, **kw):
        return lambda: claude.messages.create(model=model, max_tokens=128, tools=CLAUDE,
                                              messages=[{"role": "user", "content": question}],
                                              extra_body=GREEDY, **kw)   # (this SDK takes no temperature)
    got = _at_once({
        "any": message(ONE_CALL[0], tool_choice={"type": "any"}),
        "tool": message(ONE_CALL[1], tool_choice={"type": "tool", "name": "get_weather"}),
        "auto": message("Say hello to me in French.", tool_choice={"type": "auto"}),
        "none": message(ONE_CALL[3], tool_choice={"type": "none"}),
        "one": message(TWO_CITIES, tool_choice={"type": "any", "disable_parallel_tool_use": True}),
    })
    for kind, msg in got.items():
        uses = [(b.name, b.input) for b in msg.content if b.type == "tool_use"]
        if kind in ("auto", "none"):
            assert not uses and msg.stop_reason == "end_turn" and msg.content[0].text, (kind, msg.content)
            continue
        assert len(uses) == 1 and msg.stop_reason == "tool_use", (kind, msg.content)
        assert_valid(uses[0][0], json.dumps(uses[0][1]), ("get_weather",) if kind == "tool" else tuple(
            t["name"] for t in CLAUDE))
