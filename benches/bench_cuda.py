"""The CUDA kernels against torch on the same GPU (make gpu-check runs it).

* decode attention over the paged cache: bytes of K/V read per second, as
  a fraction of this GPU's measured device-to-device copy bandwidth (the
  goal is ≥ 70%), beside torch's gather + SDPA on the same cache;
* mask-fused sampling at V = 152,064 and B = 1 / 64 / 256 against the torch
  sequence people write (masked_fill with the unpacked mask, softmax,
  top-p by sort, multinomial), same knobs (goal ≥ 5×).

Times are CUDA-event medians of repeated launches after a warm-up. The
end-to-end decode of the default model on the GPU is not measured here:
the engine's CUDA step is not wired yet (issue 24's note says what is).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    ok, why = cuda_ops.status()
    if not (ok and torch.cuda.is_available()):
        sys.exit(f"no GPU to bench on: {why or 'torch sees no CUDA device'}")
    print(machine()["cpu_model"], "|", torch.cuda.get_device_name(), "| torch", torch.__version__)
    peak = copy_bandwidth()
    print(f"device-to-device copy: {peak / 1e9:.0f} GB/s")
    rows = attention_rows(torch.bfloat16, peak) + attention_rows(torch.float32, peak) + sampling_rows()
    for r in rows:
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    write_json(args.json, "cuda", args, rows, gpu=torch.cuda.get_device_name(), copy_bandwidth=peak)


if __name__ == "__main__":
    main()
