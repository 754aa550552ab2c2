"""Tool calls over HTTP with the official openai client, in three of the
chat layer's formats: the default model's text envelope, Hermes
(<tool_call> JSON) and Qwen3-Coder (XML parameters). The family test models
are the default weights under each family's tokenizer markers and template
(tests/helpers/families.py); what is checked is what the engine guarantees."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from helpers.families import family_path
from helpers.live_server import API_KEY, running_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "system", "content": "You are a weather assistant. " * 30},
       {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5", "qwen3-coder"])
def chat(request, family_root, default_gguf):
    """(client, model id) of a server of the family: the default model's is
    the shared server (conftest.py); the others are started here."""
    if request.param == "smollm2":
        client = openai.OpenAI(base_url=request.getfixturevalue("server") + "/v1",
                               api_key=API_KEY, max_retries=0)
        yield client, client.models.list().data[0].id
        return
    path = family_path(request.param, family_root, default_gguf)
    with running_server("--model", path, "--kv-cache-tokens", "16384") as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        yield client, client.models.list().data[0].id


def _valid(calls) -> None:
    assert calls
    for call in calls:
        assert call.id and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_named_and_auto(chat):
    """Seven requests at once (the server batches them): three with
    tool_choice "required", one naming a tool, three "auto"."""
    client, model = chat
    common = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=128, temperature=1.0)
    required = [dict(common, tool_choice="required", seed=seed, parallel_tool_calls=False)
                for seed in range(3)]
    named = [dict(common, seed=5, tool_choice={"type": "function", "function": {"name": "get_time"}})]
    auto = [dict(common, seed=seed, parallel_tool_calls=False) for seed in range(3)]
    with ThreadPoolExecutor(len(required + named + auto)) as pool:
        outs = list(pool.map(lambda kw: client.chat.completions.create(**kw),
                             required + named + auto))
    for out in outs[:3]:
        assert out.choices[0].finish_reason == "tool_calls"
        _valid(out.choices[0].message.tool_calls)
    named = outs[3]
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_time"]
    _valid(named.choices[0].message.tool_calls)
    for out in outs[4:]:
        choice = out.choices[0]
        if choice.message.tool_calls:   # the grammar makes any call it writes valid
            _valid(choice.message.tool_calls)
            assert choice.finish_reason in ("tool_calls", "length")
        else:
            assert choice.message.content is not None


def test_streamed_calls_reassemble_and_the_next_turn_hits_the_cache(chat):
    client, model = chat
    args = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96,
                temperature=0, parallel_tool_calls=False)
    full = client.chat.completions.create(**args)
    call = full.choices[0].message.tool_calls[0]
    _valid([call])
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(**args, stream=True):
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            c["id"] = d.id or c["id"]
            c["name"] = (d.function.name if d.function else None) or c["name"]
            c["arguments"] += (d.function.arguments or "") if d.function else ""
        if chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
    assert list(calls.values()) == [{"id": calls[0]["id"], "name": call.function.name,
                                     "arguments": call.function.arguments}]
    assert reasons == ["tool_calls"]
    turn2 = ASK + [full.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    second = client.chat.completions.create(model=model, messages=turn2, tools=TOOLS,
                                            max_tokens=8, temperature=0)
    previous = full.usage.prompt_tokens + full.usage.completion_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    print(f"\n{model}: cached {cached} of the previous turn's {previous} tokens "
          f"({cached / previous:.1%})")
    assert cached >= 0.95 * previous
