"""Tool calls, reasoning and response_format through LLM.chat, for every
tool-call format, on real weights with each family's real template
(tests/families.py)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from families import FAMILIES
from guided import ChatOptions, SamplingParams

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search_flights", "description": "Find flights between two airports",
    "parameters": {"type": "object", "properties": {
        "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["origin", "destination", "passengers"], "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]

names = [f.name for f in FAMILIES]


@pytest.fixture(scope="module", params=names)
def family(request):
    """Module-scoped, so pytest runs every test of one family together and
    loads each family's model once."""
    return request.param


def reasoning_only(family):
    from families import BY_NAME
    if not BY_NAME[family].reasoning:
        pytest.skip(f"{family}'s template and tokenizer have no reasoning block")


def assert_valid_calls(calls, allowed=None):
    for call in calls:
        name = call["function"]["name"]
        assert name in (allowed or SCHEMAS), call
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
        assert call["type"] == "function" and call["id"]


def sampled(n: int, max_tokens: int = 96) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s) for s in range(n)]


def test_detected_format(family, family_llm):
    from families import BY_NAME
    llm = family_llm(family)
    chat = llm.chat_format
    assert chat.tools.format.name == BY_NAME[family].tool_format
    assert (chat.reasoning is not None) == BY_NAME[family].reasoning
    eos = BY_NAME[family].eos
    assert chat.special.id_of_text(eos) in llm.engine.special.end_ids


def test_required_gives_valid_calls_at_temperature_one(family, family_llm):
    llm = family_llm(family)
    replies = llm.chat_batch([ASK] * 20, sampled(20), tools=TOOLS, tool_choice="required")
    for r in replies:
        # an untrained model may keep adding parallel calls until max_tokens:
        # the calls completed by then are returned, a cut one is not
        assert r.finish_reason in ("tool_calls", "length"), (r.finish_reason, r.output.text)
        assert r.tool_calls
        assert_valid_calls(r.tool_calls)


def test_named_choice_gives_that_tool_once(family, family_llm):
    llm = family_llm(family)
    choice = {"type": "function", "function": {"name": "search_flights"}}
    replies = llm.chat_batch([ASK] * 6, sampled(6), tools=TOOLS, tool_choice=choice)
    for r in replies:
        assert len(r.tool_calls) == 1, r.output.text
        assert_valid_calls(r.tool_calls, {"search_flights"})


def test_auto_gives_valid_calls_or_text(family, family_llm):
    llm = family_llm(family)
    replies = llm.chat_batch([ASK] * 8, sampled(8, 64), tools=TOOLS, tool_choice="auto")
    for r in replies:
        if r.tool_calls:
            assert_valid_calls(r.tool_calls)
            assert r.finish_reason == "tool_calls"
        else:
            assert r.content, r.output.text
        for ctl in llm.engine.special.control_ids:
            assert llm.engine.special.text(ctl) not in (r.content or "")


def test_parallel_false_gives_at_most_one_call(family, family_llm):
    llm = family_llm(family)
    replies = llm.chat_batch([ASK] * 6, sampled(6, 160), tools=TOOLS, tool_choice="required",
                             parallel_tool_calls=False)
    for r in replies:
        assert len(r.tool_calls) == 1


def test_json_schema_answer_after_reasoning(family, family_llm):
    reasoning_only(family)
    llm = family_llm(family)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}}
    replies = llm.chat_batch([ASK] * 4, sampled(4, 400), response_format=fmt, reasoning_effort="minimal")
    for r in replies:
        assert r.reasoning_content, r.output.text
        jsonschema.validate(json.loads(r.content), schema)
        assert r.finish_reason == "stop"


def test_reasoning_none_and_budget(family, family_llm):
    reasoning_only(family)
    llm = family_llm(family)
    start = llm.chat_format.special.id("reasoning_start")
    off = llm.chat_batch([ASK] * 4, sampled(4, 40), reasoning_effort="none")
    for r in off:
        assert r.reasoning_content is None and start not in r.output.token_ids
    budget = llm.chat(ASK, SamplingParams(max_tokens=300, temperature=1.0, seed=3),
                      reasoning_effort="minimal")
    ids = budget.output.token_ids
    end = llm.chat_format.special.id("reasoning_end")
    assert end in ids, budget.output.text
    assert ids.index(end) <= 128 + 4   # the minimal budget plus the block's markup


def reassemble(deltas) -> tuple:
    content, reasoning, calls = "", "", {}
    for d in deltas:
        content += d.content or ""
        reasoning += d.reasoning_content or ""
        for c in d.tool_calls or []:
            entry = calls.setdefault(c["index"], {"name": None, "arguments": ""})
            entry["name"] = c["function"].get("name") or entry["name"]
            entry["arguments"] += c["function"].get("arguments", "")
    return content or None, reasoning or None, [calls[i] for i in sorted(calls)]


def test_streaming_agrees_with_whole(family, family_llm):
    """The same tokens parsed one at a time (the finest a stream can be) and
    as the engine delivered them give the same message, with no control
    token in any text; chat_stream ends with the finish reason."""
    llm = family_llm(family)
    texts = [llm.engine.special.text(t) for t in llm.engine.special.control_ids]
    for options in ({"tools": TOOLS, "tool_choice": "required"},
                    {"tools": TOOLS, "tool_choice": "auto"}, {"reasoning_effort": None}):
        for seed in range(3):
            params = SamplingParams(max_tokens=48, temperature=1.0, seed=seed)
            whole = llm.chat(ASK, params, **options)
            parser = llm.prepare_chat(ASK, params, ChatOptions(**options)).parser()
            deltas = [d for t in whole.output.token_ids for d in parser.push([t])] + parser.finish()
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in whole.tool_calls]
            content, reasoning, streamed_calls = reassemble(deltas)
            assert (content, reasoning) == (whole.content, whole.reasoning_content)
            # a call cut by max_tokens was streamed in part, but is not a call
            assert streamed_calls[:len(calls)] == calls
            assert len(streamed_calls) == len(calls) or whole.finish_reason == "length"
            # a control token's text shows only where the model wrote those
            # characters as plain text tokens, never for the token itself
            shown = (whole.content or "") + (whole.reasoning_content or "") + \
                "".join(c["arguments"] for c in calls)
            control = llm.engine.special.control_ids
            plain = llm.tokenizer.decode([t for t in whole.output.token_ids if t not in control],
                                         skip_special_tokens=False)
            assert all(shown.count(t) <= plain.count(t) for t in texts), (shown, plain)
    streamed = list(llm.chat_stream(ASK, SamplingParams(max_tokens=48), tools=TOOLS,
                                    tool_choice="required"))
    assert streamed[-1].finish_reason in ("tool_calls", "length")
    assert reassemble(streamed)[2]
