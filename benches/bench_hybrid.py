"""Hybrid and latent-attention models against transformers, on the tests' tiny
random models (tests/helpers/tiny_models.py), same prompts and machine, in one
run: decode throughput at batch 1 and 16, and what each keeps per sequence.

    python benches/bench_hybrid.py [--archs lfm2 granitemoehybrid_mamba qwen3_5 deepseek_v3]
                                   [--new-tokens 256] [--batches 1 16]

Both engines run float32 weights greedily with end tokens ignored; decode
throughput is (batch × (new_tokens − 1)) / (time for new_tokens − time for one
token), each the best of three. guided runs its CPU default for float32 weights (the
torch step); LFM2 also as a Q8_0 GGUF on the native step. Per architecture it
prints the KV cache bytes per token, the recurrent state bytes per sequence
(Mamba-2's slot; LFM2 keeps none: its convolution inputs are per token) and
the ratio guided/transformers. Tiny models (hidden 64) measure the per-step
cost around the arithmetic, not the arithmetic.
"""
from __future__ import annotations

import argparse
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


def decode_rate(run, prompts, n: int) -> float:
    """tokens/s of decode: the time for n tokens less the time for one, each the best of three."""
    run(prompts, 2)   # warm-up
    full, first = (min(run(prompts, k) for _ in range(3)) for k in (n, 1))
    return len(prompts) * (n - 1) / (full - first)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", nargs="+", default=["lfm2", "granitemoehybrid_mamba", "qwen3_5", "deepseek_v3"])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers.gguf_writer import write_gguf
    from helpers.tiny_models import VOCAB, build
    print(f"CPU: {cpu_flags()}; torch threads {torch.get_num_threads()}")
    print(f"{'model':36} {'batch':>5} {'guided tok/s':>13} {'transformers':>13} {'ratio':>6}")
    for arch in args.archs:
        with tempfile.TemporaryDirectory() as d:
            hf = build(arch, d)
            engines = {"float32": LLM(d, dtype="float32", max_num_seqs=max(args.batches))}
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
            for llm in engines.values():
                llm.close()


if __name__ == "__main__":
    main()
