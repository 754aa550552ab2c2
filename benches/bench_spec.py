"""Speculative decoding on ÷ off, on the default model, interleaved in one run:

    python benches/bench_spec.py [--batches 1 8] [--reps 2] [--json out.json]

Workloads, generated here from a seed:
- extraction: a paragraph about an order (names, e-mail, address, ids drawn
  at random) and a JSON schema whose values copy from it, greedy;
- tool calls: a user turn that spells out the arguments of one of two tools
  (an e-mail to send, a table to book), tool_choice "required", greedy;
- agent loop: bench_chat's 4-turn tool-calling loop (temperature 0.7,
  seeded), turns 2-4 reported, where the conversation so far is drafted from;
- free chat: open questions, greedy: the control, where little repeats.

Two engines share nothing but the weights' file: one speculates on every
request (``LLM(speculative=True)``), one never. Each repetition runs every
workload on both, in alternating order. Printed per workload and batch:
generated tokens/s with and without, their ratio, and for the speculating
engine the tokens appended per sequence-step that carried a draft, the
share of looked-up tokens kept, and the masks computed after draft tokens
(ms in all, per step). The outputs of the two engines are compared: a
speculative output that differs is reported (it must not happen).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_chat import run as agent_loop  # noqa: E402
from machine import cpu_flags, write_json  # noqa: E402

from guided import LLM, SamplingParams  # noqa: E402

FIRST = ["Margaret", "Tomasz", "Aiyana", "Kwame", "Ingrid", "Rafael", "Sunita", "Olusegun", "Mei", "Dmitri"]
LAST = ["Okonkwo-Lindqvist", "Hernandez", "Kowalczyk", "Nakamura", "Abernathy", "Ferreira", "Iyer"]
STREETS = ["Evergreen Terrace", "Rue des Lilas", "Harbour View Road", "Maple Crescent", "Via Roma"]
CITIES = ["Springfield", "Lyon", "Wellington", "Toronto", "Bologna", "Cape Town", "Porto"]
PRODUCTS = ["Titanium Widget Pro XL", "Ceramic Pour-Over Kettle", "Trail Runner GTX 3",
            "Quantum Desk Lamp", "Merino Travel Hoodie"]
SCHEMA = {"type": "object", "properties": {
    "order_id": {"type": "string"}, "customer": {"type": "string"}, "email": {"type": "string"},
    "street": {"type": "string"}, "city": {"type": "string"}, "product": {"type": "string"},
    "quantity": {"type": "integer"}},
    "required": ["order_id", "customer", "email", "street", "city", "product", "quantity"],
    "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {
        "name": "send_email", "description": "Send an e-mail",
        "parameters": {"type": "object", "properties": {
            "to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
            "required": ["to", "subject", "body"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "book_table", "description": "Book a table at a restaurant",
        "parameters": {"type": "object", "properties": {
            "restaurant": {"type": "string"}, "name": {"type": "string"},
            "party_size": {"type": "integer", "minimum": 1}, "time": {"type": "string"}},
            "required": ["restaurant", "name", "party_size", "time"], "additionalProperties": False}}},
]
QUESTIONS = ["Why is the sky blue?", "Give me three tips for learning to cook.",
             "What makes a good night's sleep?", "Explain how a bicycle stays upright.",
             "Describe autumn in a small town.", "What should I pack for a hiking trip?",
             "How do bees make honey?", "Tell me about the history of tea."]


def person(r: random.Random) -> tuple[str, str]:
    first, last = r.choice(FIRST), r.choice(LAST)
    return f"{first} {last}", f"{first.lower()}.{last.lower()}@example.org"


def extraction(r: random.Random) -> tuple[list[dict], SamplingParams, dict]:
    name, email = person(r)
    order, qty = f"{r.randrange(10000, 99999)}-{r.choice('ABCDEFGH')}", r.randrange(1, 9)
    street, city, product = f"{r.randrange(1, 999)} {r.choice(STREETS)}", r.choice(CITIES), r.choice(PRODUCTS)
    text = (f"Order {order} was placed by {name} ({email}) for {qty} units of the {product}, "
            f"to be shipped to {street}, {city}.")
    msgs = [{"role": "user", "content": f"Extract the order as JSON.\n\n{text}"}]
    return msgs, SamplingParams(max_tokens=128, structured_outputs={"json": SCHEMA}), {}


def tool_call(r: random.Random) -> tuple[list[dict], SamplingParams, dict]:
    name, email = person(r)
    if r.random() < 0.5:
        ask = (f"Send an email to {email} with the subject \"Quarterly report for {r.choice(CITIES)}\" "
               f"and the body \"Hi {name.split()[0]}, the figures are attached. Best regards.\"")
    else:
        ask = (f"Book a table at {r.choice(['Chez Panisse', 'The Copper Kettle', 'Osteria Francescana'])} "
               f"for {r.randrange(2, 9)} people at {r.randrange(6, 10)}:30 pm under the name {name}.")
    return ([{"role": "user", "content": ask}], SamplingParams(max_tokens=128),
            {"tools": TOOLS, "tool_choice": "required"})


def free_chat(r: random.Random) -> tuple[list[dict], SamplingParams, dict]:
    return [{"role": "user", "content": r.choice(QUESTIONS)}], SamplingParams(max_tokens=128), {}


WORKLOADS = {"extraction": extraction, "tool calls": tool_call, "free chat": free_chat}


def run_chats(llm: LLM, make, batch: int, seed: int) -> tuple[float, int, list]:
    """One batch of a workload: wall seconds, tokens generated, outputs."""
    r = random.Random(seed)
    reqs = [make(r) for _ in range(batch)]
    plans = [llm.prepare_chat(m, p, llm_options(o)) for m, p, o in reqs]
    t0 = time.perf_counter()
    outs = llm.run_chat(plans)
    wall = time.perf_counter() - t0
    return wall, sum(len(o.outputs[0].token_ids) for o in outs), [o.outputs[0].token_ids for o in outs]


def llm_options(o: dict):
    from guided.chat import ChatOptions
    return ChatOptions(**o)


def run_agent(llm: LLM, batch: int) -> tuple[float, int, list]:
    """bench_chat's loop; turns 2-4's wall seconds and tokens."""
    rows = agent_loop(llm, batch, 4, 96)
    later = rows[1:]
    return (sum(r["generated"] / r["tok_s"] for r in later), sum(r["generated"] for r in later),
            [r["calls"] for r in rows])


def measure(llm: LLM, workload: str, batch: int, seed: int) -> dict:
    before = llm.stats()
    if workload == "agent loop":
        wall, tokens, outs = run_agent(llm, batch)
    else:
        wall, tokens, outs = run_chats(llm, WORKLOADS[workload], batch, seed)
    after = llm.stats()
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {"wall": wall, "tokens": tokens, "outs": outs, "stats": d}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--num-speculative-tokens", type=int, default=8)
    ap.add_argument("--dtype", default=None, help="the model's dtype (default: the CPU default)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print("cpu:", cpu_flags())
    engines = {False: LLM(dtype=args.dtype, max_num_seqs=16),
               True: LLM(dtype=args.dtype, max_num_seqs=16, speculative=True,
                         num_speculative_tokens=args.num_speculative_tokens)}
    for llm in engines.values():   # warm-up: first-call allocations, grammar compiles
        run_chats(llm, extraction, 2, 0)
        run_chats(llm, tool_call, 2, 0)
    rows = []
    for batch in args.batches:
        for workload in [*WORKLOADS, "agent loop"]:
            got = {False: [], True: []}
            for rep in range(args.reps):
                for spec in ((False, True) if rep % 2 == 0 else (True, False)):
                    got[spec].append(measure(engines[spec], workload, batch, 1000 * rep + batch))
            off_tps = sum(m["tokens"] for m in got[False]) / sum(m["wall"] for m in got[False])
            on_tps = sum(m["tokens"] for m in got[True]) / sum(m["wall"] for m in got[True])
            s = {k: sum(m["stats"].get(k, 0) for m in got[True]) for k in got[True][0]["stats"]}
            same = all(a["outs"] == b["outs"] for a, b in zip(got[False], got[True]))
            rows.append({"workload": workload, "batch": batch, "off_tok_s": off_tps, "on_tok_s": on_tps,
                         "ratio": on_tps / off_tps, "same_outputs": same,
                         "tokens_per_draft_step": s["draft_step_tokens"] / max(s["draft_steps"], 1),
                         "kept": s["draft_lookups_kept"] / max(s["draft_lookups"], 1),
                         "draft_mask_ms": s["draft_mask_us"] / 1000,
                         "draft_mask_ms_per_step": s["draft_mask_us"] / 1000 / max(s["steps"], 1)})
            r = rows[-1]
            print(f"{workload} batch {batch}: {r['ratio']:.2f}x ({r['on_tok_s']:.1f} vs {r['off_tok_s']:.1f} tok/s)",
                  flush=True)
    print("\n| workload | batch | off tok/s | on tok/s | on ÷ off | tokens per drafted step | "
          "looked-up kept | draft masks ms (per step) | same outputs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['batch']} | {r['off_tok_s']:.1f} | {r['on_tok_s']:.1f} | "
              f"{r['ratio']:.2f}× | {r['tokens_per_draft_step']:.2f} | {r['kept']:.0%} | "
              f"{r['draft_mask_ms']:.0f} ({r['draft_mask_ms_per_step']:.2f}) | {r['same_outputs']} |")
    write_json(args.json, "spec", args, rows)


if __name__ == "__main__":
    main()
