"""Rule 6: what chat() returns, sent back next turn as a client would, renders
into the tokens the model produced, so an agent loop keeps hitting the
prefix cache."""
from __future__ import annotations

import json

from guided import SamplingParams
from helpers.families import BY_NAME
from helpers.tools import TOOLS

RESULTS = {"get_weather": {"temperature": 21, "sky": "clear"},
           "search_flights": {"flights": [{"id": "AF123", "price": 420}]}}


SYSTEM = ("You are a travel assistant working for a small agency. Use the tools you are given to "
          "look things up instead of guessing: the weather tool for forecasts, the flight search "
          "for fares and schedules. Call one tool at a time, wait for its result, and when you "
          "have what you need, answer in two or three short sentences with the facts you found. "
          "Never invent prices, flight numbers or temperatures; if a tool fails, say so plainly.")


def agent_loop(llm, turns: int = 4, system: bool = True, **options) -> list[tuple[int, int, bool]]:
    """(cached tokens of this turn's prompt, prompt + completion tokens of the
    turn before, whether this prompt starts with exactly those tokens) for
    turns 2.. of a tool-calling loop."""
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    messages.append({"role": "user", "content": "Plan my trip: check the weather in Lima and find "
                                                "flights from CDG to LIM for two people."})
    ratios, previous = [], None
    for turn in range(turns):
        last = turn == turns - 1
        # the last turn is measured by its prompt alone: a short answer will do (as
        # many tokens as a family's reasoning markup needs, at least)
        [out] = llm.chat(messages, SamplingParams(max_tokens=8 if last else 64), tools=TOOLS,
                         tool_choice="none" if last else "required", parallel_tool_calls=False,
                         **options)
        reply = out.outputs[0]
        if previous is not None:
            same = out.prompt_token_ids[:len(previous)] == previous
            ratios.append((out.num_cached_tokens, len(previous), same))
        previous = out.prompt_token_ids + _rendered_back(llm, out.outputs[0])
        messages.append(reply.message())
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                             "content": json.dumps(RESULTS[call["function"]["name"]])})
        if not last:
            assert reply.tool_calls, out.text
    return ratios


def _rendered_back(llm, reply) -> list[int]:
    """The answer's tokens that the next prompt must hold as they were: all
    but its end token (a random model ends with any of the model's end
    tokens, the template writes its own: GLM's <|observation|> after calls,
    as helpers/agent_loop.py's shares take it) and the newline a model may
    write after its last call, which the grammar allows where the calls'
    separator is that whitespace (chat/grammar.py ``_trailing``) and no
    template writes back."""
    ids, special = list(reply.token_ids), llm.chat_format.special
    body = ids[:-1] if ids and ids[-1] in special.end_ids else ids
    if reply.tool_calls and body and body[-1] not in special.control_ids and \
            not llm.chat_format.tokenizer.decode(body[-1:]).strip():
        return body[:-1]
    return body


def test_agent_loop_hits_the_prefix_cache(family, family_llm):
    f = BY_NAME[family]
    llm = family_llm
    # an untrained model left to reason may never stop: no reasoning where the
    # template drops it anyway
    ratios = agent_loop(llm, system=not f.moves_system_prompt,
                        reasoning_effort="none" if f.strips_reasoning else None)
    shown = ", ".join(f"{c}/{p} = {c / p:.1%}" for c, p, _ in ratios)
    print(f"\n{family}: cached / previous prompt+completion per turn: {shown}")
    if f.rerenders_differently:
        print(f"  (measured only: {f.rerenders_differently})")
        return
    for cached, previous, same in ratios:
        # the previous turn's tokens come back exactly; the cache holds whole
        # blocks of tokens whose KV was computed
        assert same, shown
        assert cached >= 0.95 * previous, shown
