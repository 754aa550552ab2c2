"""Hybrid and latent-attention models against transformers, on the tests' tiny
random models (tests/helpers/tiny_models.py), same prompts and machine, in one
run: decode throughput at batch 1 and 16, prefill time per token of a short and a
long prompt, and what each keeps per sequence.

    python benches/bench_hybrid.py [--archs lfm2 granitemoehybrid_mamba qwen3_5 nemotron_h_moe falcon_h1
                                            deepseek_v3] [--new-tokens 256] [--batches 1 16]
                                   [--prefill 128 2048]

Both engines run float32 weights greedily with end tokens ignored; decode
throughput is (batch × (new_tokens − 1)) / (time for new_tokens − time for one
token), each the best of three. guided runs its CPU default for float32 weights (the
torch step); LFM2 also as a Q8_0 GGUF on the native step. Per architecture it
prints the KV cache bytes per token, the recurrent state bytes per sequence
(Mamba-2's slot; LFM2 keeps none: its convolution inputs are per token) and
the ratio guided/transformers. Tiny models (hidden 64) measure the per-step
cost around the arithmetic, not the arithmetic. Prefill: one prompt of each
length (the tiny config's context widened to hold it), one output token, the
best of three; the last column is the long prompt's cost per token over the
short one's (a scan token by token would keep it at 1; above 1 a prefill gets
slower per token as it grows).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from guided import LLM, SamplingParams

from machine import cpu_flags


def _guided_time(llm: LLM, prompts: list[list[int]], n: int) -> float:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def _hf_time(hf, prompts: list[list[int]], n: int) -> float:
    ids = torch.tensor(prompts)
    hf.generation_config.eos_token_id = None
    start = time.perf_counter()
    with torch.no_grad():
        hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                    min_new_tokens=n, pad_token_id=0)
    return time.perf_counter() - start


def prefill_cost(run, prompt: list[int]) -> float:
    """Seconds per prompt token of a prefill and one output token, the best of three."""
    run([prompt], 1)   # warm-up
    return min(run([prompt], 1) for _ in range(3)) / len(prompt)


def _widen_context(directory: str, hf, length: int) -> None:
    """The tiny model's context made to hold `length` tokens, for the prefill rows."""
    path = Path(directory) / "config.json"
    cfg = json.loads(path.read_text())
    for c in (cfg, cfg.get("text_config") or {}):
        if "max_position_embeddings" in c:
            c["max_position_embeddings"] = max(c["max_position_embeddings"], length)
    path.write_text(json.dumps(cfg))
    hf.config.max_position_embeddings = max(hf.config.max_position_embeddings, length)


def decode_rate(run, prompts, n: int) -> float:
    """tokens/s of decode: the time for n tokens less the time for one, each the best of three."""
    run(prompts, 2)   # warm-up
    full, first = (min(run(prompts, k) for _ in range(3)) for k in (n, 1))
    return len(prompts) * (n - 1) / (full - first)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", nargs="+", default=["lfm2", "granitemoehybrid_mamba", "qwen3_5", "nemotron_h_moe",
                                                   "falcon_h1", "deepseek_v3"])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prefill", type=int, nargs=2, default=[128, 2048], metavar=("SHORT", "LONG"))
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers.gguf_writer import write_gguf
    from helpers.tiny_models import VOCAB, build
    print(f"CPU: {cpu_flags()}; torch threads {torch.get_num_threads()}")
    print(f"{'model':36} {'batch':>5} {'guided tok/s':>13} {'transformers':>13} {'ratio':>6}")
    for arch in args.archs:
        with tempfile.TemporaryDirectory() as d:
            hf = build(arch, d)
            _widen_context(d, hf, args.prefill[1] + 8)
            engines = {"float32": LLM(d, dtype="float32", max_num_seqs=max(args.batches),
                                      max_num_batched_tokens=max(2048, args.prefill[1]),
                                      enable_prefix_caching=False)}
            if arch == "lfm2":
                engines["Q8_0 GGUF, native"] = LLM(write_gguf(d, Path(d) / "q8.gguf", "Q8_0"),
                                                   max_num_seqs=max(args.batches))
            runner = engines["float32"].engine.runner
            state = runner.states.bytes_per_sequence if runner.states is not None else 0
            print(f"{arch}: KV cache {runner.kv_bytes_per_token()} bytes per token, "
                  f"recurrent state {state} bytes per sequence")
            gen = torch.Generator().manual_seed(0)
            for batch in args.batches:
                prompts = torch.randint(0, VOCAB - 3, (batch, 24), generator=gen).tolist()
                theirs = decode_rate(lambda p, n: _hf_time(hf, p, n), prompts, args.new_tokens)
                for label, llm in engines.items():
                    ours = decode_rate(lambda p, n: _guided_time(llm, p, n), prompts, args.new_tokens)
                    print(f"{arch + ' ' + label:36} {batch:>5} {ours:>13.1f} {theirs:>13.1f} {ours / theirs:>6.2f}")
            long_short = []
            for length in args.prefill:
                prompt = torch.randint(0, VOCAB - 3, (length,), generator=gen).tolist()
                theirs = prefill_cost(lambda p, n: _hf_time(hf, p, n), prompt)
                ours = prefill_cost(lambda p, n: _guided_time(engines["float32"], p, n), prompt)
                long_short.append(ours)
                print(f"{arch + ' prefill ' + str(length):36} {'':>5} {ours * 1e6:>10.1f} us {theirs * 1e6:>10.1f} us "
                      f"{theirs / ours:>6.2f}" + (f"   long/short per token {long_short[1] / long_short[0]:.2f}"
                                                  if len(long_short) == 2 else ""))
            for llm in engines.values():
                llm.close()


if __name__ == "__main__":
    main()
