"""The CUDA kernels of ``cuda/`` for torch tensors: decode attention over
the paged KV cache, the KV-cache write, and mask-fused sampling.

The kernels are compiled into the native module at build time and launched
from Rust (``rust/cuda/launchers.rs``) on torch's current stream, with the tensors'
device pointers: nothing goes through the host. Each call's sizes, dtypes
and devices are checked in Rust before anything is launched, so a bad call
is a ValueError naming the argument, on any machine. ``status()`` says
whether the kernels can run here; the model runner asks it once, when it
starts on a device (model/runner.py), and the attention follows that choice.

Prefill attention is not here: torch's SDPA over the gathered blocks does
it on CUDA as on the CPU (python/guided/model/attention.py).
"""
from __future__ import annotations

import numpy as np
import torch

from .. import _native


#: the head sizes the decode kernel is built for (rust/cuda/reference.rs HEAD_SIZES)
HEAD_SIZES = (64, 128, 256)


def status() -> tuple[bool, str]:
    """(True, "") when the kernels can run on this machine, else (False, why not)."""
    return _native.cuda_status()


def _arg(t: torch.Tensor) -> tuple[int, list[int], str, str, bool]:
    return t.data_ptr(), list(t.shape), str(t.dtype), str(t.device), t.is_contiguous()


def _stream(t: torch.Tensor) -> int:
    # a tensor off CUDA is refused by the launcher's checks, with its name
    return torch.cuda.current_stream(t.device).cuda_stream if t.device.type == "cuda" else 0


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 out: torch.Tensor | None = None, *, window: int | None = None,
                 softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per sequence. q [seqs, heads, head] (head
    64, 128 or 256), caches [blocks, block_size, kv_heads, head] of q's
    dtype, block_tables [seqs, max_blocks] and context_lens [seqs] int32
    (the positions with KV, the new token's included). ``window``: only the
    last that many positions; ``softcap``: scores become softcap ·
    tanh(s / softcap); ``sinks``: per head a logit in the softmax without a
    value (float32 [heads]). Returns [seqs, heads, head]."""
    out = torch.empty_like(q) if out is None else out
    _native.cuda_paged_decode(_arg(q), _arg(k_cache), _arg(v_cache), _arg(block_tables),
                              _arg(context_lens), _arg(out), float(scale), int(window or 0),
                              float(softcap or 0.0), None if sinks is None else _arg(sinks), _stream(q))
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """New K/V rows [tokens, kv_heads, head] into their cache slots (int64
    [tokens]: block * block_size + offset; negative: skipped)."""
    _native.cuda_write_kv(_arg(k), _arg(v), _arg(k_cache), _arg(v_cache), _arg(slots), _stream(k_cache))


def masked_sample(logits: torch.Tensor, mask: torch.Tensor | None, temperature, top_k, top_p, min_p,
                  seeds, steps) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` [rows, vocab] (float32, on the GPU),
    drawn among the tokens ``mask`` allows (int32 [rows, words], the CPU
    sampler's packed bitmask; None: all), with per-row temperature (0:
    greedy), top_k (0: off), top_p, min_p, seed and step (the draw's
    position in its sequence). Returns (tokens int64, logprobs float32) on
    the logits' device. The per-row values are checked on the host, then
    copied over."""
    host = {"temperature": np.asarray(temperature, np.float32), "top_k": np.asarray(top_k, np.int32),
            "top_p": np.asarray(top_p, np.float32), "min_p": np.asarray(min_p, np.float32)}
    words = None if mask is None else int(mask.shape[-1])
    _native.check_sample_params(int(logits.shape[-1]), words, **host)
    device = logits.device
    dev = {k: torch.from_numpy(v).to(device, non_blocking=True) for k, v in host.items()}
    # uint64 seeds and steps cross as int64 (same bits)
    for name, values in (("seeds", seeds), ("steps", steps)):
        dev[name] = torch.from_numpy(np.asarray(values, np.uint64).view(np.int64)).to(device, non_blocking=True)
    rows = logits.shape[0]
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    _native.cuda_masked_sample(_arg(logits), None if mask is None else _arg(mask), _arg(dev["temperature"]),
                               _arg(dev["top_k"]), _arg(dev["top_p"]), _arg(dev["min_p"]),
                               _arg(dev["seeds"]), _arg(dev["steps"]), _arg(tokens), _arg(logprobs),
                               _stream(logits))
    return tokens, logprobs


def adjust_logits(logits: torch.Tensor, rows, tokens, seen, counts, bias, repetition, frequency,
                  presence) -> None:
    """Penalties, logit bias and bans, in place on ``logits`` [rows, vocab]
    (float32, on the GPU), in the CPU sampler's order: one entry per
    distinct (row, token) with whether the token was seen (prompt or
    output), its output count and its bias (-inf bans); per-row repetition,
    frequency and presence penalties. Host values, copied over."""
    host = [np.asarray(v, dtype) for v, dtype in ((rows, np.int32), (tokens, np.int32), (seen, np.int32),
                                                  (counts, np.int32), (bias, np.float32))]
    # checked on the host: a check of the device copies would wait for the GPU
    if host[1].size and (int(host[1].max()) >= logits.shape[-1] or int(host[1].min()) < 0) or \
            host[0].size and (int(host[0].max()) >= logits.shape[0] or int(host[0].min()) < 0):
        raise ValueError("adjust_logits: an entry names a row or token outside the logits")
    device = logits.device
    entries = [torch.from_numpy(v).to(device, non_blocking=True) for v in host]
    per_row = [torch.from_numpy(np.asarray(v, np.float32)).to(device, non_blocking=True)
               for v in (repetition, frequency, presence)]
    _native.cuda_adjust_logits(_arg(logits), *(_arg(t) for t in entries), *(_arg(t) for t in per_row),
                               _stream(logits))
