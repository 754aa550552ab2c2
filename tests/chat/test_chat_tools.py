"""Tool calls, reasoning and response_format through LLM.chat, for every
tool-call format, on real weights with each family's real template
(tests/helpers/families.py).

Every request a family's tests make runs in one engine batch (the ``sweep``
fixture); each test checks its own group of answers.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

from guided import ChatOptions, SamplingParams
from guided.chat.message_formats import marker_ids
from helpers.families import BY_NAME
from helpers.tools import ASK, SCHEMAS, TOOLS

NAMED = {"type": "function", "function": {"name": "search_flights"}}
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "sunny": {"type": "boolean"}},
                  "required": ["city", "sunny"], "additionalProperties": False}
WEATHER_FORMAT = {"type": "json_schema",
                  "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA, "strict": True}}
#: the option sets whose answers are parsed again token by token
STREAMED = ({"tools": TOOLS, "tool_choice": "required"}, {"tools": TOOLS, "tool_choice": "auto"},
            {"reasoning_effort": None})


def sampled(n: int, max_tokens: int = 96) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s) for s in range(n)]


#: tool choices whose answers are swept over budgets near the shortest call
CHOICES = {"required": "required", "named": NAMED, "auto": "auto"}
#: budgets above the shortest answer, and (temperature, seed) per budget
EXTRA_TOKENS = (0, 8, 16, 32)
DRAWS = ((0.0, 0), (1.0, 1), (1.0, 2))
EFFORTS = (None, "minimal", "low", "medium", "high")


def shortest(llm, options: ChatOptions) -> int:
    """Tokens of the shortest answer the request's grammar allows."""
    plan = llm.prepare_chat(ASK, SamplingParams(max_tokens=2048), options)
    found = llm.engine.grammar_compiler.compile(plan.grammar.text).matcher().shortest_completion(2048)
    return len(found)


def budget_requests(llm) -> dict[str, list[tuple[SamplingParams, ChatOptions]]]:
    """Each tool choice at budgets from its shortest call up to +32 tokens."""
    out = {}
    for name, choice in CHOICES.items():
        options = ChatOptions(tools=TOOLS, tool_choice=choice)
        least = shortest(llm, ChatOptions(tools=TOOLS, tool_choice=NAMED if name == "named" else "required"))
        out[f"budget_{name}"] = [(SamplingParams(max_tokens=least + extra, temperature=t, seed=seed), options)
                                 for extra in EXTRA_TOKENS for t, seed in DRAWS]
    return out


def reasoning_answer_requests(llm) -> list[tuple[SamplingParams, ChatOptions]]:
    """A required call or a json_schema answer with 64 tokens beyond the
    shortest answer, reasoning unset and at each effort."""
    out = []
    for effort in EFFORTS:
        for answer in ({"tools": TOOLS, "tool_choice": "required"}, {"response_format": WEATHER_FORMAT}):
            no_reasoning = ChatOptions(**answer, reasoning_effort="none")
            least = shortest(llm, no_reasoning)
            out += [(SamplingParams(max_tokens=least + 64, temperature=1.0, seed=seed),
                     ChatOptions(**answer, reasoning_effort=effort)) for seed in (0, 1)]
    return out


def requests(family: str, llm) -> dict[str, list[tuple[SamplingParams, ChatOptions]]]:
    """Each test's requests (all asking ASK), by group."""
    def group(params, **options):
        return [(p, ChatOptions(**options)) for p in params]
    out = budget_requests(llm) | {
        "required": group(sampled(20), tools=TOOLS, tool_choice="required"),
        "named": group(sampled(6), tools=TOOLS, tool_choice=NAMED),
        "auto": group(sampled(8, 64), tools=TOOLS, tool_choice="auto"),
        "parallel_false": group(sampled(6, 160), tools=TOOLS, tool_choice="required",
                                parallel_tool_calls=False),
        "streamed": [(SamplingParams(max_tokens=48, temperature=1.0, seed=seed), ChatOptions(**o))
                     for o in STREAMED for seed in range(3)],
    }
    if BY_NAME[family].reasoning:
        out |= {
            "json_after_reasoning": group(sampled(4, 400), response_format=WEATHER_FORMAT,
                                          reasoning_effort="minimal"),
            "reasoning_none": group(sampled(4, 40), reasoning_effort="none"),
            # the reasoning block must end by token 128 + 4: past 160 the
            # verdict is the same (its end is missing or late)
            "reasoning_budget": group([SamplingParams(max_tokens=160, temperature=1.0, seed=3)],
                                      reasoning_effort="minimal"),
            "reasoning_answer": reasoning_answer_requests(llm),
        }
    return out


@pytest.fixture(scope="session")
def sweep(family, family_llm) -> dict[str, list]:
    """Group → (params, options, reply) per request, all run in one batch."""
    groups = requests(family, family_llm)
    flat = [(name, p, o) for name, reqs in groups.items() for p, o in reqs]
    flat.sort(key=lambda r: -r[1].max_tokens)   # the longest first: the others run beside them
    replies = [o.outputs[0] for o in family_llm.run_chat([family_llm.prepare_chat(ASK, p, o) for _, p, o in flat])]
    out: dict[str, list] = {name: [] for name in groups}
    for (name, p, o), reply in zip(flat, replies):
        out[name].append((p, o, reply))
    return out


def replies(sweep, group: str) -> list:
    return [r for _, _, r in sweep[group]]


def reasoning_only(family):
    if not BY_NAME[family].reasoning:
        pytest.skip(f"{family}'s template and tokenizer have no reasoning block")


def assert_valid_calls(calls, allowed=None):
    for call in calls:
        name = call["function"]["name"]
        assert name in (allowed or SCHEMAS), call
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
        assert call["type"] == "function" and call["id"]


def test_detected_format(family, family_llm):
    chat = family_llm.chat_format
    assert chat.tools.format.name == BY_NAME[family].tool_format
    assert (chat.reasoning is not None) == BY_NAME[family].reasoning
    eos = BY_NAME[family].eos
    assert chat.special.id_of_text(eos) in family_llm.engine.special.end_ids


def test_required_gives_valid_calls_at_temperature_one(sweep):
    for r in replies(sweep, "required"):
        # an untrained model may keep adding parallel calls until max_tokens:
        # the calls completed by then are returned, a cut one is not
        assert r.finish_reason in ("tool_calls", "length"), (r.finish_reason, r.text)
        assert r.tool_calls
        assert_valid_calls(r.tool_calls)


def test_named_choice_gives_that_tool_once(sweep):
    for r in replies(sweep, "named"):
        assert len(r.tool_calls) == 1, r.text
        assert_valid_calls(r.tool_calls, {"search_flights"})


def test_auto_gives_valid_calls_or_text(sweep, family_llm):
    special = family_llm.engine.special
    for r in replies(sweep, "auto"):
        if r.tool_calls:
            assert_valid_calls(r.tool_calls)
            # ("length" only where a call ran into the context, which no closing shortens)
            assert r.finish_reason == "tool_calls" or r.finish_reason == "length"
        else:
            assert r.content, r.text
        for ctl in special.control_ids:
            assert special.text(ctl) not in (r.content or "")


def test_parallel_false_gives_at_most_one_call(sweep):
    for r in replies(sweep, "parallel_false"):
        assert len(r.tool_calls) == 1


def test_json_schema_answer_after_reasoning(family, sweep):
    reasoning_only(family)
    for r in replies(sweep, "json_after_reasoning"):
        assert r.reasoning_content, r.text
        jsonschema.validate(json.loads(r.content), WEATHER_SCHEMA)
        assert r.finish_reason == "stop"


def test_reasoning_none_and_budget(family, sweep, family_llm):
    reasoning_only(family)
    chat = family_llm.chat_format
    # the block's markers, one token (<think>) or several (harmony's channels)
    start, end = (marker_ids(getattr(chat.markers, k), chat.special, chat.tokenizer) for k in ("start", "end"))
    # the empty block every past answer gets (Kimi), unless the prompt holds it
    state = family_llm.prepare_chat(ASK, options=ChatOptions(reasoning_effort="none")).encoded.reasoning_state
    empty = chat.reasoning.empty if state is None else None
    for r in replies(sweep, "reasoning_none"):
        ids = r.token_ids
        assert r.reasoning_content is None
        if empty is None:
            assert find(ids, start) < 0, r.text
        else:   # the template's empty block, nothing in it
            i = find(ids, start)
            assert i >= 0 and find(ids[i + 1:], start) < 0, r.text
            assert ids[i + len(start):find(ids, end)] == family_llm.engine.tokenizer.encode_text(empty[0]), r.text
    budget, = replies(sweep, "reasoning_budget")
    at = find(budget.token_ids, end)
    assert at >= 0, budget.text
    assert at <= 128 + 4   # the minimal budget plus the block's markup


def find(ids: list[int], marker: list[int]) -> int:
    """Where ``marker`` first stands in ``ids`` (-1: nowhere)."""
    return next((i for i in range(len(ids) - len(marker) + 1) if ids[i:i + len(marker)] == marker), -1)


def test_calls_near_the_budget_are_whole_and_valid(sweep, family_llm):
    """From the shortest call up to 32 tokens more, greedy and sampled: a
    required or named choice always returns a whole valid call (closed at
    the budget where the model runs long), auto returns text or whole valid
    calls, and the answer streamed token by token is the whole answer."""
    for name in CHOICES:
        for params, options, r in sweep[f"budget_{name}"]:
            where = (name, params.max_tokens, params.seed, r.text)
            assert r.finish_reason in ("tool_calls", "length", "stop"), where
            if name == "auto" and not r.tool_calls:
                assert r.content, where
            else:
                assert r.tool_calls, where
                assert_valid_calls(r.tool_calls, {"search_flights"} if name == "named" else None)
            assert_streams_as_whole(family_llm, params, options, r)


def test_reasoning_leaves_room_for_the_answer(family, sweep):
    """With 64 tokens beyond the shortest answer, reasoning unset or at any
    effort, the required call or the json_schema answer is there and valid."""
    reasoning_only(family)
    for params, options, r in sweep["reasoning_answer"]:
        where = (options.reasoning_effort, params.max_tokens, r.text)
        if options.tools:
            assert r.tool_calls, where
            assert_valid_calls(r.tool_calls)
        else:
            jsonschema.validate(json.loads(r.content), WEATHER_SCHEMA)


def assert_streams_as_whole(llm, params, options, whole):
    """The reply's tokens parsed one at a time give the same message."""
    parser = llm.prepare_chat(ASK, params, options).parser()
    deltas = [d for t in whole.token_ids for d in parser.push([t])] + parser.finish()
    content, reasoning, calls = reassemble(deltas)
    assert (content, reasoning) == (whole.content, whole.reasoning_content)
    assert calls == [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in whole.tool_calls]


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


def test_streaming_agrees_with_whole(sweep, family_llm):
    """The same tokens parsed one at a time (the finest a stream can be) and
    as the engine delivered them give the same message, with no control
    token in any text; chat_stream ends with the finish reason."""
    llm = family_llm
    texts = [llm.engine.special.text(t) for t in llm.engine.special.control_ids]
    for params, options, whole in sweep["streamed"]:
        parser = llm.prepare_chat(ASK, params, options).parser()
        deltas = [d for t in whole.token_ids for d in parser.push([t])] + parser.finish()
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
        plain = llm.tokenizer.decode([t for t in whole.token_ids if t not in control],
                                     skip_special_tokens=False)
        assert all(shown.count(t) <= plain.count(t) for t in texts), (shown, plain)
    streamed = list(llm.chat_stream(ASK, SamplingParams(max_tokens=48), tools=TOOLS,
                                    tool_choice="required"))
    assert streamed[-1].finish_reason in ("tool_calls", "length")
    assert reassemble(streamed)[2]
