"""The OpenAI server under concurrent streaming clients, one run:

    python benches/bench_serve.py [--clients 1 8 32] [--requests 32] [--max-tokens 64]
                                  [--no-peer] [--replicas N] [--json PATH]

Starts ``python -m guided.serve`` (default model, default dtype) and, unless
--no-peer, the pure-Python stack a user would otherwise glue together:
benches/peers/hf_server.py, transformers ``generate`` with xgrammar's logits
processor behind a minimal FastAPI server (one request at a time: HF
``generate`` has no continuous batching), same GGUF, same chat template.

Workloads (same messages on both servers, temperature 0.7, seeded):
  free  plain chat answers, max_tokens tokens at most;
  json  response_format json_schema (a 6-field person);
  tool  tool_choice="required" over two tools (guided only: the peer has no
        tool-call grammar, and a JSON-schema stand-in would not be the same work).

For each concurrency N, N clients each send requests back to back until
--requests have been sent (at least N). Printed per (server, workload, N):
output tokens/s over the wall time, time to first token p50/p99, and
inter-token latency p50/p99 (gaps between streamed chunks, per token), then
guided/peer throughput ratios.

With --replicas N, the same workloads also run through `--replicas N`
(vllm-router's cache_aware policy in front of N engine processes) and the
throughput ratio to one replica is printed; then 8 three-turn tool
conversations (distinct long system prompts) run concurrently through the
fleet under cache_aware, kv_aware (the replicas' KV events) and round_robin
routing, with the default KV pool and with one of 2,048 tokens per replica
that the conversations overflow, and the share of turn 2-3 prompt tokens
found in the prefix cache is printed for each. On one machine the replicas
share its cores: this measures the router's overhead and its routing, not
added compute.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.live_server import running_server  # noqa: E402
from machine import cpu_flags, write_json  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0,
                                                         "maximum": 120},
    "city": {"type": "string", "maxLength": 30},
    "occupation": {"enum": ["engineer", "teacher", "doctor", "artist", "farmer", "other"]},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    "married": {"type": "boolean"}},
    "required": ["name", "age", "city", "occupation", "skills", "married"],
    "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
             "required": ["city"], "additionalProperties": False}}}]
SUBJECTS = ["a baker from Lyon", "a retired sailor", "a nurse from Lagos", "a poet in Dublin",
            "a chef from Naples", "a pilot from Cairo", "a teacher in Oslo", "a miner in Chile"]
WORKLOADS = {
    "free": lambda i: ({"messages": [{"role": "user", "content":
                                      f"Tell me about {SUBJECTS[i % len(SUBJECTS)]}."}]}),
    "json": lambda i: ({"messages": [{"role": "user", "content":
                                      f"Describe {SUBJECTS[i % len(SUBJECTS)]} as JSON."}],
                        "response_format": {"type": "json_schema", "json_schema": {
                            "name": "person", "schema": PERSON}}}),
    "tool": lambda i: ({"messages": [{"role": "user", "content":
                                      f"What is the weather where {SUBJECTS[i % 8]} lives?"}],
                        "tools": TOOLS, "tool_choice": "required"}),
}


async def one_request(client, model: str, body: dict, max_tokens: int, seed: int) -> dict:
    began = time.perf_counter()
    stamps, tokens = [], 0
    stream = await client.chat.completions.create(
        model=model, max_tokens=max_tokens, temperature=0.7, seed=seed, stream=True,
        stream_options={"include_usage": True}, **body)
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for c in chunk.choices:
            d = c.delta
            if d.content or d.tool_calls or getattr(d, "reasoning_content", None):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    per_token = (stamps[-1] - stamps[0]) / max(1, tokens - 1) if len(stamps) > 1 else None
    return {"ttft": (stamps[0] if stamps else time.perf_counter()) - began, "tokens": tokens,
            "gaps": gaps, "itl": per_token}


async def run_level(base: str, workload: str, clients: int, requests: int,
                    max_tokens: int) -> dict:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    total = max(requests, clients)
    counter = iter(range(total))
    results: list[dict] = []

    async def worker():
        for i in counter:
            results.append(await one_request(client, model, WORKLOADS[workload](i), max_tokens, i))

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - began
    await client.close()
    itl = [r["itl"] for r in results if r["itl"] is not None]
    ttft = [r["ttft"] for r in results]
    return {"tok_s": sum(r["tokens"] for r in results) / wall, "ttft": ttft, "itl": itl,
            "requests": len(results)}


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


def measure(name: str, server: str, base: str, workloads: list[str], args) -> dict:
    """{(workload, N): row}, each row printed as it is measured (as ``name``) and
    labelled ``server``; latencies in ms."""
    table = {}
    for workload in workloads:
        for n in args.clients:
            # Warm-up (compiles, caches) at the full budget: a schema's shortest answer may need more
            # tokens than a short budget allows, which the server refuses (400).
            asyncio.run(run_level(base, workload, 1, 1, args.max_tokens))
            r = asyncio.run(run_level(base, workload, n, args.requests, args.max_tokens))
            row = table[(workload, n)] = {
                "server": server, "workload": workload, "clients": n, "requests": r["requests"],
                "tok_s": r["tok_s"], **{f"{key}_p{q}_ms": pct(r[key], q) * 1e3
                                        for key in ("ttft", "itl") for q in (50, 99)}}
            print(f"{name:8} {workload:5} {n:3} {row['tok_s']:9.1f} {row['ttft_p50_ms']:9.0f} "
                  f"{row['ttft_p99_ms']:9.0f} {row['itl_p50_ms']:8.1f} {row['itl_p99_ms']:8.1f}", flush=True)
    return table


async def conversation_hits(base: str, conversations: int = 8) -> float:
    """Cached share of the prompt tokens of turns 2 and 3 of concurrent
    three-turn tool conversations."""
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id

    async def one(i: int) -> tuple[int, int]:
        messages = [{"role": "system", "content": f"You help traveller number {i}. " * 40},
                    {"role": "user", "content": f"What is the weather where {SUBJECTS[i % 8]} lives?"}]
        cached = prompt = 0
        for turn, choice in enumerate(("required", "required", "none")):
            out = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                       tool_choice=choice, max_tokens=48, temperature=0)
            if turn:
                cached += out.usage.prompt_tokens_details.cached_tokens
                prompt += out.usage.prompt_tokens
            if choice == "required":
                call = out.choices[0].message.tool_calls[0]
                messages += [out.choices[0].message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
        return cached, prompt

    counts = await asyncio.gather(*(one(i) for i in range(conversations)))
    await client.close()
    return sum(c for c, _ in counts) / sum(p for _, p in counts)


#: routing policies compared by cache hits; KV pools per replica: the default, and one that
#: 8 conversations overflow (so replicas evict, which only kv_aware's events tell the router)
POLICIES = ("cache_aware", "kv_aware", "round_robin")
POOLS = (None, 2048)


def fleet(args, ours: dict) -> list[dict]:
    """--replicas N against one replica: throughput, then cache hits by policy."""
    label = f"guided×{args.replicas}"
    replicas = ("--replicas", str(args.replicas))
    with running_server(*replicas, "--max-num-seqs", "64") as base:
        theirs = measure(label, f"guided, {args.replicas} replicas + vllm-router", base, list(WORKLOADS), args)
    hits = {}
    for pool in POOLS:
        for policy in POLICIES:
            sized = ("--kv-cache-tokens", str(pool)) if pool else ()
            with running_server(*replicas, "--router-policy", policy, *sized) as base:
                hits[policy, pool] = asyncio.run(conversation_hits(base))
    print(f"\nthroughput {label} (one machine's cores shared) / one replica:")
    for key, r in theirs.items():
        print(f"  {key[0]:5} N={key[1]:<3} {r['tok_s'] / ours[key]['tok_s']:6.2f}x")
    print("prefix-cache hits on turns 2-3 of 8 concurrent tool conversations:")
    for (policy, pool), share in hits.items():
        print(f"  {policy:12} KV pool {pool or 'default':>7} tokens/replica {share:6.1%}")
    return [*theirs.values(), *({"server": label, "router_policy": p, "kv_cache_tokens": pool,
                                 "turn2_3_cached_share": h} for (p, pool), h in hits.items())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=32, help="requests per (workload, N)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--replicas", type=int, default=0,
                    help="also run through --replicas N behind vllm-router (and compare routing)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows and the machine here")
    args = ap.parse_args()
    print("CPU:", cpu_flags())
    print(f"{'server':8} {'load':5} {'N':>3} {'tok/s':>9} {'ttft p50':>9} {'ttft p99':>9} "
          f"{'itl p50':>8} {'itl p99':>8}   (ms)")
    with running_server("--max-num-seqs", "64") as base:
        ours = measure("guided", "guided", base, list(WORKLOADS), args)
    rows = list(ours.values())
    if args.replicas > 1:
        rows += fleet(args, ours)
    write_json(args.json, "bench_serve", args, rows)  # kept should the peer fail
    if args.no_peer:
        return
    peer_cmd = [sys.executable, str(Path(__file__).parent / "peers" / "hf_server.py")]
    with running_server(command=peer_cmd) as base:
        theirs = measure("hf+xgr", "transformers + xgrammar", base, ["free", "json"], args)
    print("\nthroughput guided / transformers+xgrammar:")
    for key, r in theirs.items():
        print(f"  {key[0]:5} N={key[1]:<3} {ours[key]['tok_s'] / r['tok_s']:6.2f}x")
    write_json(args.json, "bench_serve", args, [*rows, *theirs.values()])


if __name__ == "__main__":
    main()
