"""A 4-turn tool-calling agent loop through LLM.chat (a batch of conversations), on the default model:

    python benches/bench_chat.py [--batch 8] [--turns 4] [--max-tokens 96] [--family gpt-oss]

Each of --batch conversations asks for a trip plan; turns 1..N-1 must call a
tool (tool_choice="required"), each call is answered with a canned tool
result, and the last turn answers in text (tool_choice="none"). The whole
conversation is sent back every turn, as an OpenAI client does.

With --budget-sweep it also runs the budget sweep: tool_choice "required"
and a named tool, on tools as OpenAI's function-calling guide writes them,
at every max_tokens from the shortest call up to +32 tokens, temperature
1.0 over --seeds seeds, and prints per budget the share of answers with
whole calls whose arguments validate, the share the closing ended, the
finish reasons, and the closing's time per request (p50, p99).

Printed per turn: prompt and generated tokens, tokens/s (generated / wall
time of the turn, prefill included), the forced-token share (tokens the
grammar appended without sampling / generated), and two cache ratios: the
prompt tokens served from the prefix cache / prompt tokens, and / the tokens
the previous turn had in the cache (its prompt + completion), which is the
round-trip figure of DESIGN.md rule 6.

With --family NAME the model is that chat family's test model
(tests/helpers/families.py: the default weights under the family's markers
and template, e.g. gpt-oss's harmony), built in a temporary directory.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

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


#: tools as OpenAI's function-calling guide writes them: open strings, an
#: enum, strict (every property required, no other)
OPENAI_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get current temperature for a given location.",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string", "description": "City and country e.g. Bogotá, Colombia"},
            "units": {"type": ["string", "null"], "enum": ["celsius", "fahrenheit"],
                      "description": "Units the temperature will be returned in."}},
            "required": ["location", "units"], "additionalProperties": False}, "strict": True}},
    {"type": "function", "function": {
        "name": "send_email", "description": "Send an email to a given recipient with a subject "
                                             "and message.",
        "parameters": {"type": "object", "properties": {
            "to": {"type": "string", "description": "The recipient email address."},
            "subject": {"type": "string", "description": "Email subject line."},
            "body": {"type": "string", "description": "Body of the email message."}},
            "required": ["to", "subject", "body"], "additionalProperties": False}, "strict": True}},
]
#: budgets beyond the shortest call, every one of them
SWEEP = range(0, 33)


def budget_sweep(llm: LLM, seeds: int) -> list[dict]:
    """Required and named calls with OPENAI_TOOLS at every budget from the
    shortest call to +32 tokens: whole calls that validate, finish
    reasons, and each request's closing time (rust/grammar/closing.rs: its first
    search, fit checks and searches), p50 and p99."""
    import jsonschema
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in OPENAI_TOOLS}
    ask = [{"role": "user", "content": "Email Ana (ana@example.com) about the weather in Paris, "
                                       "with a long, friendly message."}]
    rows = []
    for choice in ("required", {"type": "function", "function": {"name": "send_email"}}):
        options = ChatOptions(tools=OPENAI_TOOLS, tool_choice=choice)
        plan = llm.prepare_chat(ask, SamplingParams(max_tokens=2048), options)
        least = len(llm.engine.grammar_compiler.compile(plan.grammar.text).matcher().shortest_completion(2048))
        for extra in SWEEP:
            params = [SamplingParams(max_tokens=least + extra, temperature=1.0, seed=s) for s in range(seeds)]
            llm.engine.closing_times.clear()
            replies = [o.outputs[0] for o in llm.run_chat([llm.prepare_chat(ask, p, options) for p in params])]
            valid = 0
            for r in replies:
                try:
                    for call in r.tool_calls:
                        jsonschema.validate(json.loads(call["function"]["arguments"]),
                                            schemas[call["function"]["name"]])
                    valid += bool(r.tool_calls)
                except (jsonschema.ValidationError, ValueError, KeyError):
                    pass
            times = sorted(llm.engine.closing_times) or [0]
            rows.append({"choice": choice if isinstance(choice, str) else "named", "max_tokens": least + extra,
                         "valid": valid / len(replies), "closed": sum(r.closed for r in replies) / len(replies),
                         "finish": sorted({r.finish_reason for r in replies}),
                         "closing_p50_ms": times[len(times) // 2] / 1e3,
                         "closing_p99_ms": times[min(len(times) - 1, int(len(times) * 0.99))] / 1e3})
    return rows


def family_model(name: str) -> str:
    """The chat family's test model, built under a temporary directory."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from guided.model import default_model_path
    from helpers.families import family_path
    return family_path(name, Path(tempfile.mkdtemp(prefix="family-")), str(default_model_path()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--budget-sweep", action="store_true")
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--family", help="a chat family of tests/helpers/families.py (default: the default model)")
    args = ap.parse_args()
    llm = LLM(family_model(args.family), max_num_seqs=max(args.batch, 8)) if args.family else \
        LLM(max_num_seqs=max(args.batch, 8))
    run(llm, 2, 2, 64)  # warm-up: first-call allocations and grammar compiles
    rows = run(llm, args.batch, args.turns, args.max_tokens)
    print(f"\n4-turn tool-calling agent loop, batch {args.batch}, {args.family or 'default'} model "
          f"({llm.chat_format.tools.format.name} tool format)")
    print("| turn | prompt tok | generated tok | tool calls | tok/s | forced share | "
          "prompt cache hit | hit / previous prompt+completion |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        rt = f"{r['round_trip']:.1%}" if r["round_trip"] is not None else "-"
        print(f"| {r['turn']} | {r['prompt']} | {r['generated']} | {r['calls']} | {r['tok_s']:.1f} | "
              f"{r['forced']:.1%} | {r['hit']:.1%} | {rt} |")
    if args.budget_sweep:
        print(f"\nbudget sweep: OpenAI's example tools, temperature 1.0, {args.seeds} seeds per row")
        print("| tool_choice | max_tokens | whole valid calls | closed at the budget | finish | "
              "closing p50 ms | closing p99 ms |")
        print("|---|---|---|---|---|---|---|")
        for r in budget_sweep(llm, args.seeds):
            print(f"| {r['choice']} | {r['max_tokens']} | {r['valid']:.0%} | {r['closed']:.0%} | "
                  f"{','.join(r['finish'])} | {r['closing_p50_ms']:.2f} | {r['closing_p99_ms']:.2f} |")


if __name__ == "__main__":
    main()
