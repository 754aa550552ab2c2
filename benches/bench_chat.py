"""A 4-turn tool-calling agent loop through LLM.chat (a batch of conversations), on the default model:

    python benches/bench_chat.py [--batch 8] [--turns 4] [--max-tokens 96]

Each of --batch conversations asks for a trip plan; turns 1..N-1 must call a
tool (tool_choice="required"), each call is answered with a canned tool
result, and the last turn answers in text (tool_choice="none"). The whole
conversation is sent back every turn, as an OpenAI client does.

With --budget-sweep it also runs the budget sweep: tool_choice "required"
and a named tool at max_tokens from the shortest call up to +32 tokens,
temperature 1.0 over --seeds seeds, and prints per budget the share of
answers with whole calls whose arguments validate, the share that ran into
the budget (and were closed), and the forced-token share.

Printed per turn: prompt and generated tokens, tokens/s (generated / wall
time of the turn, prefill included), the forced-token share (tokens the
grammar appended without sampling / generated), and two cache ratios: the
prompt tokens served from the prefix cache / prompt tokens, and / the tokens
the previous turn had in the cache (its prompt + completion), which is the
round-trip figure of DESIGN.md rule 6.
"""
from __future__ import annotations

import argparse
import json
import time

from guided import LLM, ChatOptions, SamplingParams

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 24},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search_flights", "description": "Find flights between two airports",
        "parameters": {"type": "object", "properties": {
            "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["origin", "destination", "passengers"], "additionalProperties": False}}},
]
CITIES = ["Lima", "Oslo", "Cairo", "Perth", "Quito", "Seoul", "Dakar", "Porto",
          "Hanoi", "Tunis", "Riga", "Accra", "Bogota", "Lagos", "Minsk", "Kyoto"]
RESULTS = {"get_weather": {"temperature": 21, "sky": "clear"},
           "search_flights": {"flights": [{"id": "AF123", "price": 420}]}}


def conversations(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"I fly to {CITIES[i % len(CITIES)]} next week. Check the "
                                         "weather there and find flights for two from CDG."}]
            for i in range(n)]


def run(llm: LLM, batch: int, turns: int, max_tokens: int) -> list[dict]:
    convs = conversations(batch)
    previous = None
    rows = []
    for turn in range(turns):
        last = turn == turns - 1
        before = llm.stats()
        params = [SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=i) for i in range(batch)]
        t0 = time.perf_counter()
        outs = llm.chat(convs, params, tools=TOOLS, tool_choice="none" if last else "required",
                        parallel_tool_calls=False, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = llm.stats()
        replies = [o.outputs[0] for o in outs]
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        cached = sum(o.num_cached_tokens for o in outs)
        generated = after["generated_tokens"] - before["generated_tokens"]
        forced = after["forced_tokens"] - before["forced_tokens"]
        rows.append({"turn": turn + 1, "prompt": prompt, "generated": generated,
                     "tok_s": generated / wall, "forced": forced / max(generated, 1),
                     "hit": cached / prompt, "round_trip": cached / previous if previous else None,
                     "calls": sum(len(r.tool_calls) for r in replies)})
        previous = prompt + sum(len(r.token_ids) for r in replies)
        for conv, reply in zip(convs, replies):
            conv.append(reply.message())
            for call in reply.tool_calls:
                conv.append({"role": "tool", "tool_call_id": call["id"],
                             "content": json.dumps(RESULTS[call["function"]["name"]])})
    return rows


def budget_sweep(llm: LLM, seeds: int) -> list[dict]:
    import jsonschema
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    ask = conversations(1)[0]
    rows = []
    for choice in ("required", {"type": "function", "function": {"name": "search_flights"}}):
        plan = llm.prepare_chat(ask, SamplingParams(max_tokens=2048), ChatOptions(tools=TOOLS, tool_choice=choice))
        least = len(llm.engine.grammar_compiler.compile(plan.grammar.text).matcher().shortest_completion(2048))
        for extra in (0, 8, 16, 32):
            params = [SamplingParams(max_tokens=least + extra, temperature=1.0, seed=s) for s in range(seeds)]
            before = llm.stats()
            replies = [o.outputs[0] for o in llm.run_chat(
                [llm.prepare_chat(ask, p, ChatOptions(tools=TOOLS, tool_choice=choice)) for p in params])]
            after = llm.stats()
            valid = 0
            for r in replies:
                try:
                    for call in r.tool_calls:
                        jsonschema.validate(json.loads(call["function"]["arguments"]),
                                            schemas[call["function"]["name"]])
                    valid += bool(r.tool_calls)
                except (jsonschema.ValidationError, ValueError, KeyError):
                    pass
            generated = after["generated_tokens"] - before["generated_tokens"]
            rows.append({"choice": choice if isinstance(choice, str) else "named", "max_tokens": least + extra,
                         "valid": valid / len(replies),
                         "length": sum(r.finish_reason == "length" for r in replies) / len(replies),
                         "forced": (after["forced_tokens"] - before["forced_tokens"]) / max(generated, 1)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--budget-sweep", action="store_true")
    ap.add_argument("--seeds", type=int, default=16)
    args = ap.parse_args()
    llm = LLM(max_num_seqs=max(args.batch, 8))
    run(llm, 2, 2, 16)  # warm-up: first-call allocations and grammar compiles
    rows = run(llm, args.batch, args.turns, args.max_tokens)
    print(f"\n4-turn tool-calling agent loop, batch {args.batch}, default model "
          f"({llm.chat_format.tools.format.name} tool format)")
    print("| turn | prompt tok | generated tok | tool calls | tok/s | forced share | "
          "prompt cache hit | hit / previous prompt+completion |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        rt = f"{r['round_trip']:.1%}" if r["round_trip"] is not None else "-"
        print(f"| {r['turn']} | {r['prompt']} | {r['generated']} | {r['calls']} | {r['tok_s']:.1f} | "
              f"{r['forced']:.1%} | {r['hit']:.1%} | {rt} |")
    if args.budget_sweep:
        print(f"\nbudget sweep: temperature 1.0, {args.seeds} seeds per row")
        print("| tool_choice | max_tokens | whole valid calls | ran into the budget (closed) | forced share |")
        print("|---|---|---|---|---|")
        for r in budget_sweep(llm, args.seeds):
            print(f"| {r['choice']} | {r['max_tokens']} | {r['valid']:.0%} | {r['length']:.0%} | "
                  f"{r['forced']:.1%} |")


if __name__ == "__main__":
    main()
