"""gpt-oss's harmony format through the three APIs, with the official
clients against a live server of the gpt-oss family (the default weights
under harmony's special tokens and a harmony template,
tests/helpers/families.py): the analysis channel comes back as reasoning,
the final channel as the answer, calls from the commentary channel; streams
add up to the whole; an agent loop keeps its turns in the prefix cache.

The weights were never trained on harmony: what is checked is what the
engine guarantees by construction (grammar, parser, registry, template)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from helpers.families import family_path
from helpers.live_server import sdk_clients

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]
REPORT = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "sky": {"type": "string", "enum": ["clear", "cloudy", "rain"]}},
          "required": ["city", "sky"], "additionalProperties": False}
SYSTEM = "You are a weather assistant. " * 30
ASK = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the weather in Paris?"}]
#: harmony's markers: none may show in any text a client gets
MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>")


@pytest.fixture(scope="module")
def harmony(family_root, default_gguf):
    """(openai client, anthropic client, model id) of a gpt-oss-family server."""
    with sdk_clients(family_path("gpt-oss", family_root, default_gguf)) as clients:
        yield clients


def _clean(*texts) -> None:
    for text in texts:
        assert not any(m in (text or "") for m in MARKERS), text


def _streamed(client, **kwargs) -> tuple[str, str, dict, str]:
    """(content, reasoning, calls by index, finish_reason) of a streamed chat completion."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for c in delta.tool_calls or []:
            entry = calls.setdefault(c.index, {"name": "", "arguments": ""})
            entry["name"] += (c.function.name or "") if c.function else ""
            entry["arguments"] += (c.function.arguments or "") if c.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content, reasoning, calls, finish


def test_calls_reasoning_and_answers_in_their_fields(harmony):
    """A required call with and without reasoning, a named call, a
    json_schema answer after reasoning: each field holds its channel, whole
    and streamed alike, and the call validates."""
    client, _, model = harmony
    cases = [dict(tools=TOOLS, tool_choice="required"),
             dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  reasoning_effort="low"),
             dict(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": REPORT,
                                                                          "strict": True}},
                  reasoning_effort="low")]
    for case in cases:
        args = dict(model=model, messages=ASK, max_tokens=96, temperature=1.0, seed=3, **case)
        out = client.chat.completions.create(**args)
        whole, usage = out.choices[0], out.usage
        m = whole.message
        reasoning = getattr(m, "reasoning_content", None)
        _clean(m.content, reasoning)
        if "tools" in case:
            assert whole.finish_reason == "tool_calls" and len(m.tool_calls) == 1, whole
            assert m.tool_calls[0].function.name == "get_weather" and m.content is None
            jsonschema.validate(json.loads(m.tool_calls[0].function.arguments), WEATHER)
        else:
            assert whole.finish_reason == "stop", whole
            jsonschema.validate(json.loads(m.content), REPORT)
        if case.get("reasoning_effort"):
            assert reasoning, whole
        # the engine's count of the tokens it generated inside the analysis channel
        assert (usage.completion_tokens_details.reasoning_tokens > 0) == bool(reasoning), usage
        assert usage.completion_tokens_details.reasoning_tokens < usage.completion_tokens, usage
        content, streamed_reasoning, calls, finish = _streamed(client, **args)
        assert (content or None, streamed_reasoning or None, finish) == (m.content, reasoning, whole.finish_reason)
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
            [(c.function.name, c.function.arguments) for c in m.tool_calls or []]


def kept(out) -> int:
    """How many of a call turn's prompt and answer tokens the next prompt
    holds as they were: all of them where the model wrote its call as the
    template renders one; where it wrote another of gpt-oss's spellings (the
    analysis channel, the recipient after the channel, another content type:
    chat/tool_formats.py's harmony row), which comes back in the template's,
    those up to the call: the analysis, its four markers and `assistant`
    (the answer's text tokens, from its logprobs, whole within that text)."""
    choice, usage = out.choices[0], out.usage
    tokens = [e.token for e in choice.logprobs.content]   # its text tokens: logprobs leave markers out
    call = choice.message.tool_calls[0].function
    markers = usage.completion_tokens - len(tokens)       # the analysis's four, the call's three
    if "".join(tokens).endswith(f" to=functions.{call.name}commentary json{call.arguments}") and markers == 7:
        return usage.prompt_tokens + usage.completion_tokens
    before, n = "analysis" + (getattr(choice.message, "reasoning_content", None) or "") + "assistant", 0
    while n < len(tokens) and before.startswith("".join(tokens[:n + 1])):
        n += 1
    return usage.prompt_tokens + 4 + n


def test_agent_loop_keeps_its_turns_in_the_cache(harmony):
    """Four turns (a call with reasoning, its result, a call, its result, a
    call, its result, then the answer), each turn's messages sent back as the
    OpenAI SDK sends them: the template renders a call turn's analysis again
    (the client's reasoning_content as harmony's thinking), so each turn's
    prompt holds the previous prompt and answer (up to its call, where the
    model wrote the call in a spelling the template does not render), and
    the cache serves it."""
    client, _, model = harmony
    messages = list(ASK)
    turns = []
    for turn in range(4):
        choice = "none" if turn == 3 else "required"
        out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=choice,
                                             reasoning_effort="low", max_tokens=80, temperature=1.0, seed=turn,
                                             logprobs=True)
        turns.append(out)
        m = out.choices[0].message
        if choice == "none":
            assert out.choices[0].finish_reason in ("stop", "length") and m.content and not m.tool_calls
            _clean(m.content)
            break
        messages.append(m.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "Sunny, 21 C"})
    shares = []
    for before, after in zip(turns, turns[1:]):
        cached, keep = after.usage.prompt_tokens_details.cached_tokens, kept(before)
        shares.append((cached, keep, before.usage.prompt_tokens + before.usage.completion_tokens))
    print("\nharmony agent loop: cached / previous prompt + answer (kept as written) per turn:",
          " ".join(f"{c}/{p} ({k}) = {c / p:.1%}" for c, k, p in shares))
    # the cache holds whole blocks of 16 tokens whose KV was computed
    assert all(c >= min(0.95 * k, k - 16) for c, k, _ in shares), shares


def test_responses_and_messages(harmony):
    """The same harmony turns through /v1/responses (reasoning and
    function_call items) and /v1/messages (thinking and tool_use blocks)."""
    client, claude, model = harmony
    flat = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
             "parameters": t["function"]["parameters"]} for t in TOOLS]
    r = client.responses.create(model=model, instructions=SYSTEM, input="What is the weather in Paris?",
                                tools=flat, tool_choice="required", reasoning={"effort": "low"},
                                max_output_tokens=96, temperature=1.0, extra_body={"seed": 3})
    kinds = [o.type for o in r.output]
    assert kinds[0] == "reasoning" and kinds[-1] == "function_call", kinds
    call = r.output[-1]
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens, r.usage
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    _clean(r.output[0].content[0].text)
    with client.responses.stream(model=model, input="Say hi", max_output_tokens=24, temperature=0) as stream:
        events = list(stream)
    final = stream.get_final_response()
    assert final.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    _clean(final.output_text)

    msg = claude.messages.create(model=model, system=SYSTEM, max_tokens=96,
                                 messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                 tools=[{"name": t["name"], "description": t["description"],
                                         "input_schema": t["parameters"]} for t in flat],
                                 tool_choice={"type": "any"}, thinking={"type": "enabled", "budget_tokens": 24},
                                 # greedy (this SDK takes no temperature with thinking, the API no
                                 # seed): the same answer on every run
                                 extra_body={"temperature": 0.0})
    kinds = [b.type for b in msg.content]
    assert kinds[0] == "thinking" and kinds[-1] == "tool_use" and msg.stop_reason == "tool_use", msg.content
    jsonschema.validate(msg.content[-1].input, WEATHER)
    _clean(msg.content[0].thinking)
    # the budget ends the analysis channel (a marker of three tokens) in time: the engine's
    # own count of the tokens it sampled there, not the thinking's text encoded again
    assert 0 < msg.usage.output_tokens_details.thinking_tokens <= 24, msg.usage
