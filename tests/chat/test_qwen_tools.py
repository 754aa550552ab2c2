"""Tool calls on a real tool-calling model, offline: Qwen2.5-Coder-0.5B-Instruct
(Qwen's own Q4_K_M GGUF and template, fetched once: conftest's
``qwen_gguf``), with tools as people write them (helpers/real_tools.py).

What a user of a real model notices: the model, not the grammar, decides
how many calls it makes; "none", ``parallel_tool_calls: false``, a named
tool and ``allowed_tools`` hold; streamed answers are the whole ones; an
agent loop keeps its turns in the prefix cache; calls and JSON answers come
back whole at tight budgets. The same fields over the three HTTP APIs:
tests/serve/test_qwen_apis.py."""
from __future__ import annotations

import json

import jsonschema
import pytest

from guided import LLM, ChatOptions, SamplingParams
from helpers.agent_loop import cache_shares, run_loop
from helpers.real_tools import ONE_CALL, SCHEMAS, TOOLS, TWO_CITIES, ask, assert_valid

GREEDY_AND_SAMPLED = [SamplingParams(max_tokens=160, temperature=0.0)] + \
    [SamplingParams(max_tokens=160, temperature=1.0, seed=s) for s in (1, 2)]
REPORT = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "temperature_c": {"type": "integer"},
                                           "sky": {"type": "string", "enum": ["clear", "cloudy", "rain"]}},
          "required": ["city", "temperature_c", "sky"], "additionalProperties": False}


@pytest.fixture(scope="module")
def qwen(qwen_gguf):
    return LLM(qwen_gguf, max_num_seqs=32, kv_cache_tokens=32768)


def _run(llm, requests: list[tuple[list[dict], SamplingParams, ChatOptions]]):
    """(plan, output) per request, all in one batch."""
    plans = [llm.prepare_chat(messages, params, options) for messages, params, options in requests]
    return list(zip(plans, llm.run_chat(plans)))


def _ends_allowed(matcher, end_ids) -> bool:
    mask = matcher.compute_mask()
    return any(mask[e // 32] >> (e % 32) & 1 for e in end_ids)


def _calls(reply) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls]


def test_the_model_decides_how_many_calls(qwen):
    """Every call is valid, and where a message holds more than one call,
    the end token was allowed where each further call began: the model's
    logits, not the grammar, chose to go on (today's grammar read Qwen's
    newline after </tool_call> as the start of another call, and answered
    BFCL's triangle question with seven). Each answer, parsed token by
    token as it streams, is the whole answer."""
    requests = [(ask(q), p, ChatOptions(tools=TOOLS, tool_choice="required"))
                for q in [*ONE_CALL, TWO_CITIES] for p in GREEDY_AND_SAMPLED]
    trigger = qwen.chat_format.special.id("tool_call_start")
    ends = qwen.chat_format.special.grammar_end_ids
    counts = []
    for plan, out in _run(qwen, requests):
        reply, ids = out.outputs[0], out.outputs[0].token_ids
        assert reply.tool_calls and reply.finish_reason == "tool_calls", reply.text
        for name, args in _calls(reply):
            assert_valid(name, args)
        starts = [i for i, t in enumerate(ids) if t == trigger]
        assert len(starts) == len(reply.tool_calls), (reply.text, starts)
        for at in starts[1:]:
            m = qwen.engine.grammar_compiler.compile(plan.grammar.text).matcher()
            assert m.consume_tokens(ids[:at]) and _ends_allowed(m, ends), \
                f"call {starts.index(at) + 1} began where the grammar refused the end: {reply.text!r}"
        parser = plan.parser()
        for t in ids:
            parser.push([t])
        streamed = parser.result(out)
        assert (streamed.content, _calls(streamed)) == (reply.content, _calls(reply))
        counts.append(len(reply.tool_calls))
    print(f"\nQwen2.5-Coder-0.5B, required, calls per answer: {counts}")
    # greedy, the one-call questions get one call each (the model's own choice, as the rule allows)
    assert counts[:3 * len(ONE_CALL):3] == [1] * len(ONE_CALL), counts


def test_tool_choice_fields(qwen):
    """"none" writes no call marker at all; ``parallel_tool_calls: false``
    gives one call however often the model would go on; a named tool is
    called once; ``allowed_tools`` calls only its subset and leaves the
    prompt as it was, so the prefix cache still hits."""
    sampled = [SamplingParams(max_tokens=96, temperature=1.0, seed=s) for s in range(4)]
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_weather"}},
        {"type": "function", "function": {"name": "search_flights"}}]}}
    named = {"type": "function", "function": {"name": "send_email"}}
    groups = {
        "none": [(ask(q), p, ChatOptions(tools=TOOLS, tool_choice="none")) for q in (ONE_CALL[0], TWO_CITIES)
                 for p in sampled],
        "one": [(ask(TWO_CITIES), p, ChatOptions(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
                for p in sampled],
        "named": [(ask(q), sampled[0], ChatOptions(tools=TOOLS, tool_choice=named)) for q in ONE_CALL[:3]],
        "allowed": [(ask(q), sampled[0], ChatOptions(tools=TOOLS, tool_choice=allowed)) for q in ONE_CALL],
    }
    flat = [(name, r) for name, reqs in groups.items() for r in reqs]
    done = _run(qwen, [r for _, r in flat])
    trigger = qwen.chat_format.special.id("tool_call_start")
    for (group, _), (plan, out) in zip(flat, done):
        reply = out.outputs[0]
        if group == "none":
            assert not reply.tool_calls and trigger not in reply.token_ids and reply.finish_reason in ("stop", "length")
            continue
        calls = _calls(reply)
        assert calls, (group, reply.text)
        for name, args in calls:
            assert_valid(name, args, {"one": SCHEMAS, "named": ("send_email",),
                                      "allowed": ("get_weather", "search_flights")}[group])
        assert group == "allowed" or len(calls) == 1, (group, calls)

    # the same prompt as with every tool callable: a second ask hits the cache whole
    plain = qwen.prepare_chat(ask(ONE_CALL[1]), sampled[0], ChatOptions(tools=TOOLS, tool_choice="required"))
    narrowed = qwen.prepare_chat(ask(ONE_CALL[1]), sampled[0], ChatOptions(tools=TOOLS, tool_choice=allowed))
    assert narrowed.prompt_ids == plain.prompt_ids
    [out] = qwen.run_chat([narrowed])
    block = qwen.engine.config.block_size
    assert out.num_cached_tokens >= (len(plain.prompt_ids) - 1) // block * block, out.num_cached_tokens


def test_agent_loop_keeps_the_prefix_cache(qwen):
    """Four turns as an OpenAI client runs them (the reply sent back as
    returned, a result per call): each prompt starts with the previous
    prompt and answer, and at least 95% of them comes from the cache."""
    turns = run_loop(qwen)
    outs = [out for *_, out in turns]
    for _, _, options, out in turns[:-1]:
        assert out.outputs[0].tool_calls, out.outputs[0].text
    shares = cache_shares(outs, qwen.chat_format.special.end_ids)
    print("\nQwen agent loop, cached / previous prompt + answer:", [f"{c}/{p}" for c, p, _ in shares])
    for cached, previous, same in shares:
        assert cached / previous >= 0.95, shares


def test_calls_and_json_whole_at_tight_budgets(qwen):
    """A required call and a JSON answer at budgets from the shortest the
    grammar allows upward, greedy and sampled: whole, valid, never cut."""
    requests = []
    for options in (ChatOptions(tools=TOOLS, tool_choice="required"),
                    ChatOptions(response_format={"type": "json_schema", "json_schema": {
                        "name": "report", "schema": REPORT, "strict": True}})):
        plan = qwen.prepare_chat(ask(ONE_CALL[1]), SamplingParams(max_tokens=512), options)
        least = len(qwen.engine.grammar_compiler.compile(plan.grammar.text).matcher().shortest_completion(512))
        requests += [(ask(ONE_CALL[1]), SamplingParams(max_tokens=least + extra, temperature=t, seed=extra),
                      options) for extra in (0, 2, 5, 12) for t in (0.0, 1.0)]
    for (_, params, options), (_, out) in zip(requests, _run(qwen, requests)):
        reply = out.outputs[0]
        assert len(reply.token_ids) <= params.max_tokens
        if options.tools:
            assert reply.tool_calls and reply.finish_reason == "tool_calls", (params.max_tokens, reply.text)
            for name, args in _calls(reply):
                assert_valid(name, args)
        else:
            assert reply.finish_reason == "stop", (params.max_tokens, reply.text)
            jsonschema.validate(json.loads(reply.content), REPORT)
