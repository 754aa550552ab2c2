"""A four-turn agent loop as an OpenAI client runs it, for the models of a
family's own architecture (helpers/family_model.py): the reply sent back as
returned (content, reasoning_content, tool_calls), then a "tool" message per
call; a call required on every turn but the last, which answers in text."""
from __future__ import annotations

import copy
import json

from guided import SamplingParams

from .tools import ASK, TOOLS

SYSTEM = {"role": "system", "content": "You are a weather assistant. Look the weather up with the "
                                       "tools you are given; never guess a temperature."}
RESULTS = {"get_weather": {"temperature": 21, "sky": "clear"},
           "search_flights": {"flights": [{"id": "AF123", "price": 420}]}}
TURNS = 4


def turn_options(turn: int, **extra) -> dict:
    """A call required, then text on the last turn (`extra`: the same on every turn)."""
    return {"tools": TOOLS, "tool_choice": "none" if turn == TURNS - 1 else "required", **extra}


def run_loop(llm, **extra) -> list[tuple[list[dict], SamplingParams, dict, object]]:
    """Each turn's (messages sent, sampling, options, RequestOutput)."""
    messages = [SYSTEM, *ASK]
    turns = []
    for turn in range(TURNS):
        params, options = SamplingParams(max_tokens=80, temperature=1.0, seed=turn), turn_options(turn, **extra)
        [out] = llm.chat(messages, params, use_tqdm=False, **options)
        turns.append((copy.deepcopy(messages), params, options, out))
        reply = out.outputs[0]
        messages.append({"role": "assistant", "content": reply.content,
                         "reasoning_content": reply.reasoning_content, "tool_calls": reply.tool_calls})
        messages += [{"role": "tool", "tool_call_id": call["id"],
                      "content": json.dumps(RESULTS[call["function"]["name"]])} for call in reply.tool_calls]
    return turns


def cache_shares(outs, end_ids=frozenset()) -> list[tuple[int, int, bool]]:
    """Per turn after the first: (its cached tokens, the previous prompt and answer's length,
    whether its prompt starts with them token for token). `end_ids`: end tokens the template
    may write back as its own end of turn (a random model ends with any of the model's)."""
    shares = []
    for before, out in zip(outs, outs[1:]):
        previous = before.prompt_token_ids + before.outputs[0].token_ids
        kept = previous[:-1] if previous[-1] in end_ids else previous
        shares.append((out.num_cached_tokens, len(previous), out.prompt_token_ids[:len(kept)] == kept))
    return shares
