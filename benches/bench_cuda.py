"""The CUDA kernels against torch on the same GPU (make gpu-check runs it).

* decode attention over the paged cache: bytes of K/V read per second, as
  a fraction of this GPU's measured device-to-device copy bandwidth (the
  goal is ≥ 70%), beside torch's gather + SDPA on the same cache;
* mask-fused sampling at V = 152,064 and B = 1 / 64 / 256 against the torch
  sequence people write (masked_fill with the unpacked mask, softmax,
  top-p by sort, multinomial), same knobs (goal ≥ 5×);
* end to end, the default model on this GPU in bfloat16: decode tok/s at
  batch 1 / 16 / 64 of guided (decode steps as CUDA graphs, the default;
  eager steps; sampling on the host) against transformers' ``generate`` in the same dtype, same
  prompts (decode = (n - 1) tokens per row over the time n tokens take
  beyond one, as bench_generate.py measures it); and constrained ÷ free at
  batch 64 (bench_guided_e2e.py's JSON schema and method: free decoding
  gets the constrained run's lengths; goal ≥ 0.99).

Kernel times are CUDA-event medians of repeated launches after a warm-up;
engine times the best of --repeat wall-clock runs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine, write_json  # noqa: E402

from guided.model import cuda_ops  # noqa: E402


def timed(fn, repeats: int = 50) -> float:
    """Median seconds per call, by CUDA events."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / timed(lambda: b.copy_(a), 20)


def attention_rows(dtype: torch.dtype, peak: float) -> list[dict]:
    rows = []
    for seqs, ctx in ((1, 4096), (64, 1024), (64, 4096), (256, 2048)):
        heads, kv_heads, head, block = 32, 8, 128, 16
        blocks_per = ctx // block
        kc = torch.randn(seqs * blocks_per, block, kv_heads, head, device="cuda", dtype=dtype)
        vc = torch.randn_like(kc)
        q = torch.randn(seqs, heads, head, device="cuda", dtype=dtype)
        tables = torch.randperm(seqs * blocks_per, device="cuda").view(seqs, blocks_per).int()
        lens = torch.full((seqs,), ctx, device="cuda", dtype=torch.int32)
        out = torch.empty_like(q)
        ours = timed(lambda: cuda_ops.paged_decode(q, kc, vc, tables, lens, head ** -0.5, out))

        def gathered():
            keys = kc[tables.long()].view(seqs, -1, kv_heads, head).transpose(1, 2)
            values = vc[tables.long()].view(seqs, -1, kv_heads, head).transpose(1, 2)
            return F.scaled_dot_product_attention(q.view(seqs, heads, 1, head), keys, values,
                                                  enable_gqa=True)
        theirs = timed(gathered)
        read = 2 * kc.numel() * kc.element_size()
        rows.append({"kernel": "paged_decode", "dtype": str(dtype), "seqs": seqs, "context": ctx,
                     "ours_ms": ours * 1e3, "torch_ms": theirs * 1e3, "speedup": theirs / ours,
                     "bandwidth_GBs": read / ours / 1e9, "of_copy_bandwidth": read / ours / peak})
    return rows


def sampling_rows() -> list[dict]:
    vocab, rows_out = 152_064, []
    for batch in (1, 64, 256):
        logits = torch.randn(batch, vocab, device="cuda") * 4
        allowed = torch.rand(batch, vocab, device="cuda") < 0.05
        # the packed words (bit j of word i: token 32 i + j), as int32
        bits = F.pad(allowed, (0, -vocab % 32)).view(batch, -1, 32).long()
        words = (bits << torch.arange(32, device="cuda")).sum(-1)
        mask = torch.where(words >= 2**31, words - 2**32, words).int()
        knobs = dict(temperature=[0.8] * batch, top_k=[0] * batch, top_p=[0.9] * batch,
                     min_p=[0.0] * batch, seeds=list(range(batch)), steps=[0] * batch)
        ours = timed(lambda: cuda_ops.masked_sample(logits, mask, **knobs))

        def torch_way():
            x = logits.masked_fill(~allowed, float("-inf")) / 0.8
            probs, order = torch.softmax(x, -1).sort(descending=True)
            drop = probs.cumsum(-1) - probs >= 0.9
            probs = probs.masked_fill(drop, 0)
            pick = torch.multinomial(probs, 1)
            return order.gather(1, pick)
        theirs = timed(torch_way)
        rows_out.append({"kernel": "masked_sample", "batch": batch, "vocab": vocab, "ours_ms": ours * 1e3,
                         "torch_ms": theirs * 1e3, "speedup": theirs / ours})
    return rows_out


def engine_rows(repeat: int, new_tokens: int = 128, device: str = "cuda", batches=(1, 16, 64)) -> list[dict]:
    import transformers
    from bench_generate import best_of, prompts
    from bench_guided_e2e import prompt_ids, run_guided

    from guided import LLM, SamplingParams
    from guided.model import default_model_path
    path = Path(default_model_path())
    # dense bfloat16 weights, as guided runs them on a GPU (newer transformers keep a GGUF's
    # blocks packed unless told to dequantize)
    dense = {"quantization_config": transformers.GgufConfig(gguf_file=path.name, dequantize=True)} \
        if hasattr(transformers, "GgufConfig") else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.bfloat16, **dense).to(device).eval()
    weights = sorted({str(p.dtype) for p in hf.parameters()})
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # decode steps as CUDA graphs (the default) and eager (--cuda-graphs off), side by side
    engines = {mode: LLM(str(path), device=device, dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=64,
                         kv_cache_tokens=1 << 16, cuda_graphs=mode) for mode in ("auto", "off")}
    llm = engines["auto"]
    on_device = llm.engine.runner.sampler
    rows = []
    for batch in batches:
        ps = prompts(batch)
        ids = torch.tensor([tok.encode(p) for p in ps], device=device)

        def hf_gen(n: int):
            with torch.inference_mode():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=tok.pad_token_id or 0)
            if device == "cuda":
                torch.cuda.synchronize()

        def ours(n: int, sampler, engine=llm):
            runner = engine.engine.runner
            before, runner.sampler = runner.sampler, sampler
            try:
                engine.generate(ps, SamplingParams(max_tokens=n, ignore_eos=True))
            finally:
                runner.sampler = before

        runs = {"transformers": hf_gen, "guided": lambda n: ours(n, on_device),
                "guided, eager steps": lambda n: ours(n, engines["off"].engine.runner.sampler, engines["off"]),
                "guided, host sampling": lambda n: ours(n, None)}
        for name, gen in runs.items():
            gen(4)  # warm-up
            first = best_of(lambda: gen(1), repeat)
            full = best_of(lambda: gen(new_tokens), repeat)
            rows.append({"engine": name, "batch": batch, "dtype": "bfloat16", "new_tokens": new_tokens,
                         "weights": "+".join(weights) if name == "transformers" else "bfloat16",
                         "prefill_ms": first * 1e3,
                         "decode_tok_s": batch * (new_tokens - 1) / (full - first)})
        ref = rows[-len(runs)]["decode_tok_s"]
        for r in rows[1 - len(runs):]:
            r["over_transformers"] = r["decode_tok_s"] / ref
    r = run_guided(llm, prompt_ids(tok, batches[-1]), new_tokens, repeat)
    rows.append({"engine": "guided", "batch": batches[-1], "dtype": "bfloat16", "tokens": r["tokens"],
                 "valid_json": r["valid_json"], "constrained_tok_s": r["con_tps"], "free_tok_s": r["free_tps"],
                 "constrained_over_free": r["con_tps"] / r["free_tps"], "ff_off_over_free": r["ff_off_tps"] / r["free_tps"],
                 "forced_tokens": r["forced_tokens"], "steps": r["steps"],
                 "mask_ms": r["mask_time_us"] / 1e3, "mask_waited_ms": r["mask_wait_us"] / 1e3})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--repeat", type=int, default=3, help="engine runs: best of this many")
    ap.add_argument("--skip-engine", action="store_true", help="the kernels only")
    ap.add_argument("--skip-kernels", action="store_true", help="the engine only")
    args = ap.parse_args()
    ok, why = cuda_ops.status()
    if not (ok and torch.cuda.is_available()):
        sys.exit(f"no GPU to bench on: {why or 'torch sees no CUDA device'}")
    print(machine()["cpu_model"], "|", torch.cuda.get_device_name(), "| torch", torch.__version__)
    peak = copy_bandwidth()
    print(f"device-to-device copy: {peak / 1e9:.0f} GB/s")
    rows = []
    if not args.skip_kernels:
        rows = attention_rows(torch.bfloat16, peak) + attention_rows(torch.float32, peak) + sampling_rows()
        show(rows)
        write_json(args.json, "cuda", args, rows, gpu=torch.cuda.get_device_name(), copy_bandwidth=peak)
    if not args.skip_engine:
        more = engine_rows(args.repeat)
        show(more)
        rows += more
        write_json(args.json, "cuda", args, rows, gpu=torch.cuda.get_device_name(), copy_bandwidth=peak)


def show(rows: list[dict]) -> None:
    for r in rows:
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
              flush=True)


if __name__ == "__main__":
    main()
