"""The agent APIs, with the official clients against live servers:
OpenAI's Responses API (/v1/responses: the `openai` SDK and the Agents
SDK's default model) and Anthropic's Messages API (/v1/messages: the
`anthropic` SDK). Both go through the chat layer that /v1/chat/completions
uses, so what is checked is what that layer guarantees, in each API's own
shape: calls that validate, answers that validate, reasoning apart from
the answer, streams that add up to the whole, and tool loops whose turns
hit the prefix cache.

The default model's server is the shared one (conftest.py); reasoning is
checked on the qwen3 family (the default weights under Qwen3's template
and <think> markers, tests/helpers/families.py)."""
from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor

import anthropic
import jsonschema
import openai
import pytest

from helpers.families import family_path
from helpers.live_server import API_KEY, get, post, sdk_clients

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"], "additionalProperties": False}
WEATHER_ARGS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER_ARGS, "get_time": CITY}
#: Responses' function tools (flat) and Messages' tools (input_schema)
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER_ARGS},
         {"type": "function", "name": "get_time", "description": "Local time in a city",
          "parameters": CITY}]
CLAUDE_TOOLS = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
                for t in TOOLS]
#: a long system prompt, so that one turn's prompt is most of the next one's
#: (what a turn cannot leave in the cache: its last block, partly filled,
#: and the tokens after the last one sampled, which the grammar forced and
#: no forward pass computed)
SYSTEM = "You are a weather assistant. " * 30
LONG_SYSTEM = SYSTEM * 2
ASK = "What is the weather in Paris?"
REPORT = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "temperature": {"type": "integer"},
    "sky": {"type": "string", "enum": ["clear", "cloudy", "rain"]}},
    "required": ["city", "temperature", "sky"], "additionalProperties": False}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def oai(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0)
    return client, client.models.list().data[0].id


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def thinker(family_root, default_gguf):
    """(openai client, anthropic client, model id) of a qwen3-family server."""
    with sdk_clients(family_path("qwen3", family_root, default_gguf)) as clients:
        yield clients


def _valid_call(name: str, arguments: str | dict) -> None:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])


def _blocks(message) -> list[dict]:
    """A message's content blocks, less the call ids (new in every answer)."""
    return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in message.content]


def _in_parallel(fn, calls: list[dict]) -> list:
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda kw: fn(**kw), calls))


# -- /v1/responses -----------------------------------------------------------


def test_responses_tools_required_named_and_auto(oai):
    client, model = oai
    common = dict(model=model, instructions=SYSTEM, input=ASK, tools=TOOLS, max_output_tokens=96,
                  parallel_tool_calls=False, temperature=1.0)
    outs = _in_parallel(client.responses.create, [
        dict(common, tool_choice="required"),
        dict(common, tool_choice={"type": "function", "name": "get_time"}),
        dict(common, tool_choice="auto"),
        dict(common, tool_choice="none")])
    required, named, auto, none = outs
    calls = [o for o in required.output if o.type == "function_call"]
    assert calls and required.status == "completed"
    for call in calls:
        assert call.call_id and call.id.startswith("fc_") and call.status == "completed"
        _valid_call(call.name, call.arguments)
    assert [o.name for o in named.output if o.type == "function_call"] == ["get_time"]
    for o in auto.output:   # the server enforces the tool grammar for auto too
        if o.type == "function_call":
            _valid_call(o.name, o.arguments)
    assert [o.type for o in none.output] == ["message"] and none.output_text
    for o in outs:
        assert o.id.startswith("resp_") and o.object == "response"
        assert o.usage.input_tokens > 0 and o.usage.total_tokens == \
            o.usage.input_tokens + o.usage.output_tokens


def test_responses_json_schema_strict(oai):
    client, model = oai
    out = client.responses.create(
        model=model, input="Report the weather in Paris as JSON.", max_output_tokens=80,
        text={"format": {"type": "json_schema", "name": "report", "schema": REPORT, "strict": True}})
    jsonschema.validate(json.loads(out.output_text), REPORT)
    obj = client.responses.create(model=model, input="Give a JSON object.", max_output_tokens=40,
                                  text={"format": {"type": "json_object"}}, **GREEDY)
    assert isinstance(json.loads(obj.output_text), dict)


def test_responses_stream_adds_up_to_the_whole(oai):
    """Typed events in order, numbered from 0; their deltas rebuild the
    same output as the same request answered whole (greedy)."""
    client, model = oai
    for args in (dict(input="Name the capital of France.", max_output_tokens=24),
                 dict(instructions=SYSTEM, input=ASK, tools=TOOLS, tool_choice="required",
                      parallel_tool_calls=False, max_output_tokens=96)):
        whole = client.responses.create(model=model, **args, **GREEDY)
        with client.responses.stream(model=model, **args, **GREEDY) as stream:
            events = list(stream)
            final = stream.get_final_response()
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        texts: dict[int, str] = {}
        for e in events:
            if e.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
                texts[e.output_index] = texts.get(e.output_index, "") + e.delta
        added = [e.item.type for e in events if e.type == "response.output_item.added"]
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert added == [o.type for o in whole.output] == [o.type for o in done]
        for i, item in enumerate(whole.output):
            if item.type == "message":
                assert texts[i] == item.content[0].text == done[i].content[0].text
            else:
                assert texts[i] == item.arguments == done[i].arguments
                assert item.name == done[i].name
        assert final.output_text == whole.output_text
        assert final.usage.output_tokens == whole.usage.output_tokens


def test_responses_tool_loop_hits_the_cache(oai):
    """Three turns: the output items and a function_call_output sent back in
    full, then by previous_response_id (the stored conversation)."""
    client, model = oai
    common = dict(model=model, instructions=LONG_SYSTEM, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=64, **GREEDY)
    conversation: list = [{"role": "user", "content": ASK}]
    first = client.responses.create(input=conversation, **common)
    call = next(o for o in first.output if o.type == "function_call")
    conversation += [o.model_dump(exclude_none=True) for o in first.output]
    conversation.append({"type": "function_call_output", "call_id": call.call_id,
                         "output": '{"temperature": 21}'})
    second = client.responses.create(input=conversation, **common)
    call2 = next(o for o in second.output if o.type == "function_call")
    third = client.responses.create(
        previous_response_id=second.id, **dict(common, tool_choice="none"),
        input=[{"type": "function_call_output", "call_id": call2.call_id, "output": "12:00"}])
    assert third.output_text and third.previous_response_id == second.id
    for before, after in ((first, second), (second, third)):
        previous = before.usage.input_tokens + before.usage.output_tokens
        cached = after.usage.input_tokens_details.cached_tokens
        print(f"\ncached {cached} of the previous turn's {previous} tokens ({cached / previous:.1%})")
        assert cached >= 0.95 * previous
    # the stored response, and what an unknown one gets
    assert client.responses.retrieve(second.id).id == second.id
    with pytest.raises(openai.NotFoundError):
        client.responses.create(previous_response_id="resp_unknown", input="hi", **common)


def test_responses_store_item_reference_and_delete(oai):
    """store=False keeps nothing; an item_reference stands for the stored
    item itself (same prompt as the item sent in full); a deleted response
    and its items are gone."""
    client, model = oai
    unkept = client.responses.create(model=model, input="Say hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    common = dict(model=model, instructions=SYSTEM, tools=TOOLS, parallel_tool_calls=False,
                  max_output_tokens=48, **GREEDY)
    first = client.responses.create(input=ASK, tool_choice="required", **common)
    call = next(o for o in first.output if o.type == "function_call")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}
    by_reference = client.responses.create(
        input=[{"role": "user", "content": ASK}, {"type": "item_reference", "id": call.id}, result],
        tool_choice="none", **common)
    in_full = client.responses.create(
        input=[{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), result],
        tool_choice="none", **common)
    assert by_reference.usage.input_tokens == in_full.usage.input_tokens
    assert by_reference.output_text == in_full.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input=[{"type": "item_reference", "id": call.id}], **common)


def test_responses_reasoning_item_then_answer(thinker):
    client, _, model = thinker
    args = dict(model=model, input="What is 2 + 2?", reasoning={"effort": "low"},
                max_output_tokens=160, **GREEDY)
    whole = client.responses.create(**args)
    kinds = [o.type for o in whole.output]
    assert kinds[0] == "reasoning" and "message" in kinds[1:], kinds
    thought = whole.output[0].content[0].text
    assert thought and "<think>" not in thought and "<think>" not in whole.output_text
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens <= whole.usage.output_tokens
    with client.responses.stream(**args) as stream:
        events = list(stream)
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == thought
    # reasoning sent back as an input item renders as the template's past reasoning
    again = client.responses.create(model=model, max_output_tokens=8, input=[
        {"role": "user", "content": "What is 2 + 2?"},
        *[o.model_dump(exclude_none=True) for o in whole.output],
        {"role": "user", "content": "And 3 + 3?"}])
    assert again.status in ("completed", "incomplete")


# -- /v1/messages ------------------------------------------------------------


def test_messages_tools_any_named_and_auto(claude, oai):
    model = oai[1]
    common = dict(model=model, system=SYSTEM, max_tokens=96, tools=CLAUDE_TOOLS,
                  messages=[{"role": "user", "content": ASK}])
    one = {"disable_parallel_tool_use": True}
    outs = _in_parallel(claude.messages.create, [
        dict(common, tool_choice={"type": "any", **one}),
        dict(common, tool_choice={"type": "tool", "name": "get_time", **one}),
        dict(common, tool_choice={"type": "auto", **one}),
        dict(common, tool_choice={"type": "none"})])
    anyone, named, auto, none = outs
    uses = [b for b in anyone.content if b.type == "tool_use"]
    assert uses and anyone.stop_reason == "tool_use"
    for b in uses:
        _valid_call(b.name, b.input)
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_time"]
    for b in auto.content:
        if b.type == "tool_use":
            _valid_call(b.name, b.input)
    assert [b.type for b in none.content] == ["text"]
    assert none.stop_reason in ("end_turn", "max_tokens")
    for o in outs:
        assert o.id.startswith("msg_") and o.type == "message" and o.role == "assistant"


def test_messages_stream_adds_up_and_count_tokens(claude, oai):
    model = oai[1]
    for args in (dict(messages=[{"role": "user", "content": "Name the capital of France."}],
                      max_tokens=24, stop_sequences=["Paris"]),
                 dict(system=SYSTEM, messages=[{"role": "user", "content": ASK}], max_tokens=96,
                      tools=CLAUDE_TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True})):
        whole = claude.messages.create(model=model, **args, extra_body=GREEDY)
        with claude.messages.stream(model=model, **args, extra_body=GREEDY) as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert _blocks(final) == _blocks(whole)
        assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
        assert final.usage.output_tokens == whole.usage.output_tokens
        counted = claude.messages.count_tokens(model=model, **{k: v for k, v in args.items()
                                                                if k not in ("max_tokens", "stop_sequences")})
        assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert whole.stop_reason == "tool_use"


def test_messages_stop_sequence(claude, oai):
    out = claude.messages.create(model=oai[1], max_tokens=24, stop_sequences=["Paris"],
                                 messages=[{"role": "user", "content": "Name the capital of France."}],
                                 extra_body=GREEDY)
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", "Paris")
    assert "Paris" not in out.content[0].text


def test_messages_tool_loop_hits_the_cache(claude, oai):
    model = oai[1]
    common = dict(model=model, system=LONG_SYSTEM, max_tokens=64, tools=CLAUDE_TOOLS,
                  tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    messages: list = [{"role": "user", "content": ASK}]
    turns = []
    for result in ('{"temperature": 21}', "12:00", None):
        if result is None:
            common["tool_choice"] = {"type": "none"}
        out = claude.messages.create(messages=messages, **common)
        turns.append(out)
        if result is None:
            break
        use = next(b for b in out.content if b.type == "tool_use")
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in out.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": result}]}]
    assert turns[-1].content[0].type == "text"
    for before, after in zip(turns, turns[1:]):
        previous = before.usage.input_tokens + before.usage.cache_read_input_tokens + \
            before.usage.output_tokens
        cached = after.usage.cache_read_input_tokens
        print(f"\ncached {cached} of the previous turn's {previous} tokens ({cached / previous:.1%})")
        assert cached >= 0.95 * previous


def test_messages_thinking_within_its_budget(thinker):
    _, claude_client, model = thinker
    args = dict(model=model, max_tokens=160, thinking={"type": "enabled", "budget_tokens": 24},
                messages=[{"role": "user", "content": "What is 2 + 2?"}], extra_body=GREEDY)
    whole = claude_client.messages.create(**args)
    kinds = [b.type for b in whole.content]
    # the budget ends the block mid-sentence; this model may then end its turn
    assert kinds[0] == "thinking" and set(kinds[1:]) <= {"text"}, whole.content
    assert whole.stop_reason == "end_turn"
    thought = whole.content[0].thinking
    # the engine's count of the tokens it generated in the block, within the budget
    assert thought and 0 < whole.usage.output_tokens_details.thinking_tokens <= 24, whole.usage
    with claude_client.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(whole)
    assert final.usage.output_tokens_details == whole.usage.output_tokens_details
    off = claude_client.messages.create(**{**args, "thinking": {"type": "disabled"}})
    assert all(b.type == "text" for b in off.content)   # no thinking block
    assert off.usage.output_tokens_details.thinking_tokens == 0
    # the answer sent back with its thinking block (as Anthropic's clients do) is taken
    again = claude_client.messages.create(**{**args, "max_tokens": 8, "thinking": {"type": "disabled"},
                                             "messages": [*args["messages"],
                                                          {"role": "assistant", "content": [
                                                              b.model_dump() for b in whole.content]},
                                                          {"role": "user", "content": "And 3 + 3?"}]})
    assert again.type == "message" and again.stop_reason in ("end_turn", "max_tokens")


# -- the Agents SDK ----------------------------------------------------------


def test_one_conversation_one_prompt_through_three_apis(server, oai, claude):
    """A tool call and its result, sent through chat completions, then
    Responses, then Messages: the same prompt tokens each time, and the
    second and third find it in the prefix cache."""
    client, model = oai
    args = {"city": "Paris", "unit": "celsius"}
    result = '{"temperature": 21}'
    chat = client.chat.completions.create(
        model=model, max_tokens=1, tool_choice="none", **GREEDY,
        tools=[{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
               for t in TOOLS],
        messages=[{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": ASK},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": result}])
    responses = client.responses.create(
        model=model, max_output_tokens=1, tool_choice="none", tools=TOOLS, instructions=LONG_SYSTEM,
        **GREEDY, input=[{"role": "user", "content": ASK},
                         {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                          "arguments": json.dumps(args)},
                         {"type": "function_call_output", "call_id": "call_1", "output": result}])
    messages = claude.messages.create(
        model=model, max_tokens=1, tool_choice={"type": "none"}, tools=CLAUDE_TOOLS, system=LONG_SYSTEM,
        extra_body=GREEDY, messages=[
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                               "input": args}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                          "content": result}]}])
    prompt = chat.usage.prompt_tokens
    assert responses.usage.input_tokens == prompt
    assert messages.usage.input_tokens + messages.usage.cache_read_input_tokens == prompt
    for cached in (responses.usage.input_tokens_details.cached_tokens,
                   messages.usage.cache_read_input_tokens):
        assert cached >= 0.95 * prompt, (cached, prompt)


def test_render_endpoints_give_the_prompt_tokens(server, oai):
    """vLLM's render endpoints (what vllm-router's cache-aware routing reads):
    the token ids each request's prompt renders to, nothing generated."""
    client, model = oai
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    chat_tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
                  for t in TOOLS]
    body = {"model": model, "messages": messages, "tools": chat_tools, "max_tokens": 1}
    status, _, text = post(server + "/v1/chat/completions/render", json.dumps(body).encode(), API_KEY)
    assert status == 200, text
    ids = json.loads(text)["token_ids"]
    answered = client.chat.completions.create(**body)
    assert len(ids) == answered.usage.prompt_tokens
    status, _, text = post(server + "/v1/responses/render", json.dumps(
        {"model": model, "instructions": SYSTEM, "input": ASK, "tools": TOOLS}).encode(), API_KEY)
    assert status == 200 and json.loads(text)["token_ids"] == ids, text
    for prompt, count in (("Hello there", 1), ([1, 2, 3], 1), (["a", "b c"], 2)):
        status, _, text = post(server + "/v1/completions/render", json.dumps(
            {"model": model, "prompt": prompt}).encode(), API_KEY)
        rows = [r["token_ids"] for r in json.loads(text)]
        assert status == 200 and len(rows) == count and all(rows), text
        assert prompt != [1, 2, 3] or rows == [[1, 2, 3]]
    status, _, text = post(server + "/v1/chat/completions/render", json.dumps(
        {"model": "nope", "messages": messages}).encode(), API_KEY)
    assert status == 404, text


def test_openai_agents_default_model(server, oai):
    """openai-agents' OpenAIResponsesModel: a function-tool loop (the call,
    its output sent back, the answer) and a run with an output_type. The
    tool is offered until it has been called once (the SDK's is_enabled):
    this 135M model calls any tool it is offered again and again."""
    agents = pytest.importorskip("agents")
    from pydantic import BaseModel

    agents.set_tracing_disabled(True)
    called: list[str] = []

    @agents.function_tool(is_enabled=lambda ctx, agent: not called)
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        called.append(city)
        return f"Sunny and 21 C in {city}"

    class Report(BaseModel):
        city: str
        temperature: int

    async def run():
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0)
        model = agents.OpenAIResponsesModel(model=oai[1], openai_client=client)
        settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                        max_tokens=64, temperature=0)
        loop = await agents.Runner.run(agents.Agent(
            name="weather", instructions="You answer questions about the weather.",
            tools=[get_weather], model=model, model_settings=settings), ASK, max_turns=4)
        typed = await agents.Runner.run(agents.Agent(
            name="report", instructions="Report the weather as JSON.", model=model,
            output_type=Report, model_settings=agents.ModelSettings(max_tokens=64, temperature=0)),
            "It is 21 C in Paris.")
        return loop, typed

    loop, typed = asyncio.run(run())
    kinds = [type(item).__name__ for item in loop.new_items]
    assert called and kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and \
        kinds[-1] == "MessageOutputItem", kinds
    assert isinstance(loop.final_output, str) and loop.final_output
    assert isinstance(typed.final_output, Report)


# -- bad input ---------------------------------------------------------------

_BAD = [
    ("/v1/responses", {"input": [{"type": "computer_call"}]}, 400, "not supported"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "nope",
                                  "output": "x"}]}, 400, "no function_call"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                          "schema": {"type": "nonsense"}}}},
     400, "schema"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}, 400, "only function tools"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": "many"}, 400, "max_output_tokens"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image",
                                                               "image_url": "x"}]}]},
     400, "input_image"),
    ("/v1/responses", {"input": "hi", "previous_response_id": "resp_gone"}, 404, "resp_gone"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}, 400, "max_tokens"),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]}, 400, "toolu_x"),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                      "tools": [{"name": "f", "input_schema": {"type": "object",
                                                               "properties": {"a": {"type": 3}}}}]},
     400, "tools[0]"),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                      "temperature": "hot"}, 400, "temperature"),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                      "thinking": {"type": "enabled", "budget_tokens": 2}}, 400, "no reasoning block"),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                      "tool_choice": {"type": "tool", "name": "absent"}}, 400, "absent"),
    ("/v1/messages/count_tokens", {"messages": []}, 400, "messages"),
]


@pytest.mark.parametrize("path, body, status, needle", _BAD,
                         ids=[f"{p.rsplit('/', 1)[1]}-{n}" for p, _, _, n in _BAD])
def test_bad_input_in_each_apis_shape(server, path, body, status, needle):
    got, _, text = post(server + path, json.dumps({"model": "served", **body}).encode(), API_KEY)
    answer = json.loads(text)
    assert got == status, text
    if path.startswith("/v1/messages"):
        assert answer["type"] == "error" and answer["error"]["type"] in (
            "invalid_request_error", "not_found_error")
        message = answer["error"]["message"]
    else:
        message = answer["error"]["message"]
        assert answer["error"]["type"]
    assert needle in message, message
    assert get(server + "/health")[0] == 200


def test_the_chat_limits_hold_on_the_new_endpoints(server, small_server):
    """The grammar size limit, the bounded queue (503, in each API's shape)
    and the request counters by endpoint and status."""
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                             for i in range(300)}}
    for path, body in (("/v1/responses", {"input": "hi", "text": {"format": {
            "type": "json_schema", "name": "x", "schema": huge}}}),
            ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"name": "f", "input_schema": huge}]})):
        status, _, text = post(server + path, json.dumps({"model": "served", **body}).encode(), API_KEY)
        assert status == 400 and "--max-grammar-bytes" in text, text

    async def burst(call, overloaded):
        async def one(i):
            try:
                await call(i)
                return 200
            except (openai.APIStatusError, anthropic.APIStatusError) as err:
                assert err.status_code == 503 and err.response.headers.get("retry-after"), err
                overloaded(err.body)
                return 503
        return await asyncio.gather(*(one(i) for i in range(12)))

    async def main():
        oai_client = openai.AsyncOpenAI(base_url=small_server + "/v1", api_key="x", max_retries=0)
        claude_client = anthropic.AsyncAnthropic(base_url=small_server, api_key="x", max_retries=0)
        model = (await oai_client.models.list()).data[0].id
        ask = "Count from 1 to 100: 1, 2, 3,"
        responses = await burst(lambda i: oai_client.responses.create(
            model=model, input=f"{i}. {ask}", max_output_tokens=24, temperature=0),
            lambda body: body["message"])
        messages = await burst(lambda i: claude_client.messages.create(
            model=model, max_tokens=24, messages=[{"role": "user", "content": f"{i}. {ask}"}]),
            lambda body: body["error"]["type"] == "overloaded_error" or pytest.fail(str(body)))
        return responses, messages
    # 6 fit (2 running + 4 waiting); the rest arrive while those still run
    for results in asyncio.run(main()):
        assert results.count(503) >= 4 and results.count(200) >= 6, results
    counted = get(server + "/metrics")[1] + get(small_server + "/metrics")[1]
    for endpoint in ("responses", "messages"):
        assert re.search(rf'guided_requests_total{{endpoint="{endpoint}",[^}}]*status="200"', counted)
        for status in ("200", "400", "503"):
            assert f'guided_http_responses_total{{path="/v1/{endpoint}",status="{status}"}}' in counted, \
                (endpoint, status)


def test_anthropic_key_and_errors(server, oai):
    """x-api-key is how Anthropic's clients send the key; a wrong one is a
    401 in Anthropic's shape, and the SDK raises its own errors."""
    wrong = anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        wrong.messages.create(model=oai[1], max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["error"]["type"] == "authentication_error"
    right = anthropic.Anthropic(base_url=server, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        right.messages.create(model="no-such-model", max_tokens=4,
                              messages=[{"role": "user", "content": "hi"}])
