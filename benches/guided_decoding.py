"""Guided decoding figures on the default model, in one run:

    python benches/guided_decoding.py [--batch 16]

1. mask time per token (p50, p99): a matcher walking model-generated JSON,
   one compute_mask per token (single thread, the Rust call timed from Python);
2. the engine at batch B: mask job wall time per step and per row, and the
   share hidden behind the forward pass (1 − mask_wait / mask_time);
3. forced-token share: fast-forwarded tokens / output tokens on one schema;
4. decode throughput constrained / unconstrained at batch B, same number of
   tokens per row (a schema whose output has a fixed length), with and
   without fast-forward (forced tokens are fed as prefill chunks, so a
   constrained run can take fewer steps than a free one).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from guided import LLM, SamplingParams

PROMPT = "<|im_start|>user\nDescribe a customer as JSON.<|im_end|>\n<|im_start|>assistant\n"

CUSTOMER = {
    "type": "object",
    "properties": {
        "customer_identifier": {"type": "integer", "minimum": 0, "maximum": 10**6},
        "full_name": {"type": "string", "maxLength": 24},
        "email_address": {"type": "string", "format": "email", "maxLength": 40},
        "membership_level": {"enum": ["bronze", "silver", "gold"]},
        "favourite_colours": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "is_active": {"type": "boolean"},
    },
    "required": ["customer_identifier", "full_name", "email_address", "membership_level",
                 "favourite_colours", "is_active"],
    "additionalProperties": False,
}

# 60 one-digit integers, compact: the same number of tokens in every row.
FIXED = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
         "minItems": 60, "maxItems": 60}


def delta(llm: LLM, before: dict) -> dict:
    after = llm.stats()
    return {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], int)}


def mask_times(llm: LLM, outputs) -> np.ndarray:
    grammar = llm.compile_grammar({"json": CUSTOMER})
    times = []
    for out in outputs:
        m = grammar.matcher()
        for t in out.token_ids:
            t0 = time.perf_counter()
            m.compute_mask()
            times.append(time.perf_counter() - t0)
            if not m.consume_token(t):
                break
    return np.array(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    b = args.batch
    llm = LLM(max_num_seqs=max(32, b))
    llm.generate([PROMPT], SamplingParams(max_tokens=8))  # warm-up

    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=i,
                             structured_outputs={"json": CUSTOMER}) for i in range(b)]
    before = llm.stats()
    outs = llm.generate([PROMPT] * b, params)
    d = delta(llm, before)
    valid = sum(1 for o in outs if o.finish_reason == "stop" and json.loads(o.text) is not None)
    us = mask_times(llm, outs)
    print(f"schema 'customer', batch {b}: {valid}/{b} valid JSON, "
          f"{d['generated_tokens']} output tokens in {d['steps']} steps")
    print(f"  mask per token (walk, 1 thread): p50 {np.percentile(us, 50):.0f} us, "
          f"p99 {np.percentile(us, 99):.0f} us over {len(us)} tokens")
    per_step = d["mask_time_us"] / max(1, d["steps"])
    hidden = 1 - d["mask_wait_us"] / max(1, d["mask_time_us"])
    print(f"  engine masks: {per_step:.0f} us per step, {d['mask_time_us'] / max(1, d['mask_rows']):.0f} us "
          f"per row (rows in parallel), {100 * hidden:.1f}% hidden behind the forward")
    print(f"  forced tokens: {d['forced_tokens']} of {d['generated_tokens']} "
          f"({100 * d['forced_tokens'] / max(1, d['generated_tokens']):.1f}%)")

    fixed = SamplingParams(max_tokens=200, structured_outputs={"json": FIXED, "whitespace": "compact"})
    probe = llm.generate([PROMPT], fixed)[0]
    n = len(probe.token_ids)
    free = SamplingParams(max_tokens=n, ignore_eos=True)
    no_ff = SamplingParams(max_tokens=200, fast_forward=False,
                           structured_outputs={"json": FIXED, "whitespace": "compact"})
    rates = {}
    runs = (("unconstrained", free), ("constrained", fixed), ("constrained, no fast-forward", no_ff))
    for name, p in runs * 2:
        t0 = time.perf_counter()
        outs = llm.generate([PROMPT] * b, p)
        dt = time.perf_counter() - t0
        rates[name] = max(rates.get(name, 0), sum(len(o.token_ids) for o in outs) / dt)
    print(f"throughput at batch {b}, {n} tokens per row (best of 2):")
    for name, rate in rates.items():
        print(f"  {name:30s} {rate:6.0f} tok/s  ratio {rate / rates['unconstrained']:.3f}")


if __name__ == "__main__":
    main()
