"""Rule 6: what chat() returns, sent back next turn as a client would, renders
into the tokens the model produced, so an agent loop keeps hitting the
prefix cache."""
from __future__ import annotations

import json

import pytest

from families import FAMILIES
from guided import SamplingParams
from test_chat_tools import TOOLS

RESULTS = {"get_weather": {"temperature": 21, "sky": "clear"},
           "search_flights": {"flights": [{"id": "AF123", "price": 420}]}}


def agent_loop(llm, turns: int = 4) -> list[tuple[int, int]]:
    """(cached tokens of this turn's prompt, prompt + completion tokens of the
    turn before) for turns 2.. of a tool-calling loop."""
    messages = [{"role": "user", "content": "Plan my trip: check the weather in Lima and find "
                                            "flights from CDG to LIM for two people."}]
    ratios, previous = [], None
    for turn in range(turns):
        last = turn == turns - 1
        reply = llm.chat(messages, SamplingParams(max_tokens=64), tools=TOOLS,
                         tool_choice="none" if last else "required", parallel_tool_calls=False)
        out = reply.output
        if previous is not None:
            ratios.append((out.num_cached_tokens, previous))
        previous = len(out.prompt_token_ids) + len(out.token_ids)
        messages.append(reply.message())
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                             "content": json.dumps(RESULTS[call["function"]["name"]])})
        if not last:
            assert reply.tool_calls, out.text
    return ratios


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_agent_loop_hits_the_prefix_cache(family, family_llm):
    from families import BY_NAME
    llm = family_llm(family)
    ratios = agent_loop(llm)
    shown = ", ".join(f"{c}/{p} = {c / p:.1%}" for c, p in ratios)
    print(f"\n{family}: cached / previous prompt+completion per turn: {shown}")
    if BY_NAME[family].strips_reasoning:
        return  # the template drops past reasoning: measured, not asserted
    for cached, previous in ratios:
        assert cached >= 0.95 * previous, shown
