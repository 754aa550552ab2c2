"""Attention over the paged KV cache.

The cache of one layer is a pair of [num_blocks, block_size, kv_heads, head_dim]
tensors. New K/V rows are scattered in by slot id; a sequence's keys are read
back by gathering its blocks through its block-table row.

What depends only on the step (which blocks to gather, the masks) is worked out
once per forward in an AttentionPlan and reused by every layer.

On a CPU every layer's attention is one native call (rust/cpu/cpu_attention.rs): each
query row is computed on its own and reads the cache in place, so a row's
result is the same whatever batch, chunk or cached prefix it comes with
(windows, soft-caps and sinks included). The rest of this file is the torch
path, which CUDA steps take.

Grouped-query attention is done without copying K/V per query head: the g query
heads that share a kv head are stacked as extra query rows of that kv head, so
SDPA sees [.., kv_heads, g*Q, d] queries against [.., kv_heads, L, d] keys.

Where the model runner chose our CUDA kernels (model/cuda_ops.py;
AttentionMetadata.kernels), a decode-only step reads the paged cache in place
with cuda/paged_attention.cu instead of gathering it (head sizes 64, 128 and
256; windows, soft-caps and sinks included), and new K/V rows are written by
its write kernel; prefill stays with SDPA over the gathered blocks.

A sliding-window layer (Gemma, Mistral, EXAONE 4, gpt-oss) reads the same
blocks with a mask that keeps the last `window` positions; scores are
soft-capped where the model asks (Gemma 2), and a head's learned sink logit
joins its softmax (gpt-oss), which SDPA cannot do, so on the torch path
those layers compute attention in plain torch. Blocks behind every window are not released: the
architectures that slide all have full-attention layers too (Gemma, EXAONE
4) or slide wider than the contexts served (Mistral's 4k–32k), and a block
shared through the prefix cache must stay whole for the next request.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from .. import _native
from . import cuda_ops


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [T] int64: block_id * block_size + offset for each new token
    block_tables: torch.Tensor     # [B, M] int32: each sequence's physical blocks, padded with 0
    context_lens: torch.Tensor     # [B] int32: tokens with KV after this step, new ones included
    query_start_loc: torch.Tensor  # [B+1] int32: sequence b owns rows query_start_loc[b]:[b+1]
    max_query_len: int
    max_context_len: int
    block_size: int
    is_decode_only: bool
    kernels: bool = False          # our CUDA kernels run this step (the runner's choice, made once)
    #: the step's heavy ops are all native (quantized linears): the native kernels' threads spin
    #: between calls; otherwise they sleep at once and leave the cores to torch's
    native_only: bool = False


@dataclass
class _Gather:
    """Which blocks to read for a group of sequences, and how far."""
    blocks: torch.Tensor   # [S * nb] int64: each sequence's blocks, flattened
    num_seqs: int
    length: int            # positions kept per sequence (the longest context in the group)
    # K and V land in the same two buffers in every layer: a fresh multi-MB tensor per layer
    # costs a page-faulting allocation that took longer than the copy itself
    buffers: list[torch.Tensor | None] = field(default_factory=lambda: [None, None])


class _Masks:
    """Which cached positions each query row may read, per window size (None:
    all of them, causally), built the first time a layer asks."""

    def __init__(self, keys: torch.Tensor, queries: torch.Tensor):
        self.keys, self.queries = keys, queries    # positions: [.., L] of keys, [.., 1] of queries
        self._made: dict[int | None, torch.Tensor] = {}

    def __call__(self, window: int | None) -> torch.Tensor:
        if window not in self._made:
            mask = self.keys <= self.queries
            if window is not None:
                mask &= self.keys > self.queries - window
            self._made[window] = mask
        return self._made[window]


@dataclass
class _DecodeGroup:
    rows: torch.Tensor | None  # query rows of the group (None: all rows, in order)
    gather: _Gather
    masks: _Masks              # [S, 1, 1, L] bool: position < context length (and in the window)


@dataclass
class _PrefillChunk:
    start: int
    end: int
    gather: _Gather
    masks: _Masks              # [n, ctx] bool, causal, offset by the tokens cached before the chunk


@dataclass
class _CpuRows:
    """The native CPU attention's view of a step: each query row's sequence
    (a row of `tables`) and position."""
    tables: np.ndarray   # [B, M] int32
    seq: np.ndarray      # [T] int32
    pos: np.ndarray      # [T] int32

    @staticmethod
    def of(attn: AttentionMetadata) -> _CpuRows:
        counts = np.diff(attn.query_start_loc.numpy()).astype(np.int64)
        seq = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
        first = attn.context_lens.numpy().astype(np.int64) - counts        # each sequence's first new position
        offset = np.arange(int(counts.sum())) - np.repeat(attn.query_start_loc.numpy()[:-1].astype(np.int64), counts)
        pos = (np.repeat(first, counts) + offset).astype(np.int32)
        return _CpuRows(np.ascontiguousarray(attn.block_tables.numpy(), dtype=np.int32), seq, pos)


#: Where our CUDA decode kernel runs, a sequence with at most this many new
#: tokens in a mixed step (a decode, the tokens a grammar forced after its
#: sampled one, a short prefill chunk) attends through it, one query row per
#: token with its own context length, instead of a gather and SDPA of its own.
KERNEL_QUERY_TOKENS = 16


class AttentionPlan:
    """`native` (on a CPU): attention by rust/cpu/cpu_attention.rs, each row on its own
    (the same result in any batch, chunk or cache state); False keeps torch's
    SDPA over gathered blocks, the path a CUDA prefill takes. `head_dim`: the
    model's, which says whether the CUDA decode kernel is built for it."""

    def __init__(self, attn: AttentionMetadata, device: torch.device, native: bool = True,
                 head_dim: int | None = None):
        self.block_size = attn.block_size
        self.slot_mapping = attn.slot_mapping.to(device=device, dtype=torch.long)
        self.kernels = attn.kernels
        self.cpu_rows = _CpuRows.of(attn) if native and device.type == "cpu" else None
        self.native_only = attn.native_only
        self.decode: _DecodeGroup | None = None
        self.prefills: list[_PrefillChunk] = []
        #: (block tables, context lengths) as int32, one row per query token, for the CUDA
        #: decode kernel; `kernel_rows`: those tokens' rows in the step (None: all of them)
        self.kernel_decode: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kernel_rows: torch.Tensor | None = None
        kernel = attn.kernels and head_dim in cuda_ops.HEAD_SIZES
        if attn.is_decode_only and kernel:
            self.kernel_decode = (attn.block_tables.to(device=device, dtype=torch.int32),
                                  attn.context_lens.to(device=device, dtype=torch.int32))
            return
        if self.cpu_rows is not None:
            return
        tables = attn.block_tables.to(device=device, dtype=torch.long)
        lens = attn.context_lens.to(device=device, dtype=torch.long)
        if attn.is_decode_only:
            self.decode = self._decode_group(None, tables, lens, attn.max_context_len)
            return
        self._plan_mixed(attn, tables, lens, device, kernel)

    def _gather(self, tables: torch.Tensor, length: int) -> _Gather:
        nb = -(-length // self.block_size)
        return _Gather(tables[:, :nb].reshape(-1), tables.shape[0], length)

    def _decode_group(self, rows, tables, lens, length) -> _DecodeGroup:
        keys = torch.arange(length, device=tables.device).view(1, 1, 1, -1)
        return _DecodeGroup(rows, self._gather(tables, length), _Masks(keys, (lens - 1).view(-1, 1, 1, 1)))

    def _plan_mixed(self, attn, tables, lens, device, kernel: bool) -> None:
        starts = attn.query_start_loc.tolist()
        ctx_lens = attn.context_lens.tolist()
        decode_seqs, decode_rows = [], []
        k_rows, k_seqs, k_lens = [], [], []
        for i, ctx in enumerate(ctx_lens):
            s, e = starts[i], starts[i + 1]
            if kernel and 0 < e - s <= KERNEL_QUERY_TOKENS:
                k_rows += range(s, e)
                k_seqs += [i] * (e - s)
                k_lens += range(ctx - (e - s) + 1, ctx + 1)
            elif e - s == 1:
                decode_seqs.append(i)
                decode_rows.append(s)
            elif e > s:
                qpos = torch.arange(ctx - (e - s), ctx, device=device)
                masks = _Masks(torch.arange(ctx, device=device)[None, :], qpos[:, None])
                self.prefills.append(_PrefillChunk(s, e, self._gather(tables[i:i + 1], ctx), masks))
        if k_rows:
            seqs = torch.tensor(k_seqs, device=device)
            self.kernel_decode = (tables.index_select(0, seqs).int(), torch.tensor(k_lens, dtype=torch.int32,
                                                                                     device=device))
            if len(k_rows) < starts[-1]:
                self.kernel_rows = torch.tensor(k_rows, device=device)
        if decode_seqs:
            seqs = torch.tensor(decode_seqs, device=device)
            self.decode = self._decode_group(
                torch.tensor(decode_rows, device=device), tables.index_select(0, seqs),
                lens.index_select(0, seqs), max(ctx_lens[i] for i in decode_seqs))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             plan: AttentionPlan) -> None:
    """Scatter the new tokens' K/V ([T, kv, d]) into their cache slots."""
    if plan.kernels:
        cuda_ops.write_kv(k.to(k_cache.dtype).contiguous(), v.to(v_cache.dtype).contiguous(),
                          k_cache, v_cache, plan.slot_mapping)
        return
    kv, d = k_cache.shape[-2:]
    k_cache.view(-1, kv, d).index_copy_(0, plan.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv, d).index_copy_(0, plan.slot_mapping, v.to(v_cache.dtype))


@dataclass(frozen=True)
class Scores:
    """How a layer turns q·k into weights: the scale, the window, the soft-cap."""
    scale: float
    window: int | None = None
    softcap: float | None = None


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    plan: AttentionPlan, scores: Scores, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, d] for the new tokens (their K/V already written); `sinks` [H]: each
    head's sink logit, where the layer has them. Returns [T, H*d] in q's dtype; the
    cache may hold a narrower one."""
    if plan.cpu_rows is not None:
        return _native_cpu(q, k_cache, v_cache, plan, scores, sinks)
    if q.dtype != k_cache.dtype:
        return paged_attention(q.to(k_cache.dtype), k_cache, v_cache, plan, scores, sinks).to(q.dtype)
    t, h, d = q.shape
    kernel_out = None
    if plan.kernel_decode is not None:
        tables, lens = plan.kernel_decode
        rows = q if plan.kernel_rows is None else q.index_select(0, plan.kernel_rows)
        kernel_out = cuda_ops.paged_decode(rows.contiguous(), k_cache, v_cache, tables, lens, scores.scale,
                                           window=scores.window, softcap=scores.softcap,
                                           sinks=None if sinks is None else sinks.float().contiguous()
                                           ).view(-1, h * d)
        if plan.kernel_rows is None:
            return kernel_out
    group = plan.decode
    if group is not None and group.rows is None:
        return _decode(q, k_cache, v_cache, group, scores, sinks)
    out = torch.empty(t, h * d, dtype=q.dtype, device=q.device)
    if kernel_out is not None:
        out[plan.kernel_rows] = kernel_out
    for chunk in plan.prefills:
        out[chunk.start:chunk.end] = _prefill(q[chunk.start:chunk.end], k_cache, v_cache, chunk, scores, sinks)
    if group is not None:
        out[group.rows] = _decode(q.index_select(0, group.rows), k_cache, v_cache, group, scores, sinks)
    return out


def _native_cpu(q, k_cache, v_cache, plan: AttentionPlan, scores: Scores, sinks) -> torch.Tensor:
    t, h, d = q.shape
    rows = plan.cpu_rows
    out = torch.empty(t, h, d)
    caches = [c.numpy() if c.dtype == torch.float32 else c.view(torch.int16).numpy().view(np.uint16)
              for c in (k_cache, v_cache)]
    _native.cpu_paged_attention(
        q.float().contiguous().numpy(), *caches, rows.tables, rows.seq, rows.pos, out.numpy(),
        scores.scale, scores.window, scores.softcap,
        None if sinks is None else sinks.float().contiguous().numpy(), plan.native_only)
    return out.view(t, h * d).to(q.dtype)


def _attend(q, keys, values, mask, scores: Scores, sinks: torch.Tensor | None = None):
    """`sinks`: per query row, a logit that joins the softmax and takes its share of the
    weight without a value (broadcast against q's [.., rows, 1])."""
    if scores.softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scores.scale)
    weights = q @ keys.transpose(-1, -2) * scores.scale
    if scores.softcap is not None:
        weights = torch.tanh(weights / scores.softcap) * scores.softcap
    weights = weights.masked_fill(~mask, float("-inf"))
    if sinks is None:
        weights = weights.softmax(dim=-1, dtype=torch.float32)
    else:
        sink = sinks.to(weights.dtype).expand(*weights.shape[:-1], 1)
        weights = torch.cat([weights, sink], dim=-1).softmax(dim=-1, dtype=torch.float32)[..., :-1]
    return weights.to(values.dtype) @ values


def _read(cache: torch.Tensor, g: _Gather, which: int) -> torch.Tensor:
    """[S, kv, length, d]: the group's cached positions, gathered in one index_select."""
    kv, d = cache.shape[-2:]
    buf = g.buffers[which]
    if buf is None or buf.dtype != cache.dtype:
        buf = g.buffers[which] = cache.new_empty((g.blocks.numel(), *cache.shape[1:]))
    torch.index_select(cache, 0, g.blocks, out=buf)
    return buf.view(g.num_seqs, -1, kv, d)[:, :g.length].transpose(1, 2)


def _decode(q, k_cache, v_cache, group: _DecodeGroup, scores: Scores, sinks=None):
    """One new token per sequence: one batched SDPA, keys past each context masked out."""
    b, h, d = q.shape
    kv = k_cache.shape[-2]
    keys = _read(k_cache, group.gather, 0)
    values = _read(v_cache, group.gather, 1)
    sinks = None if sinks is None else sinks.view(kv, h // kv, 1)
    out = _attend(q.view(b, kv, h // kv, d), keys, values, group.masks(scores.window), scores, sinks)
    return out.reshape(b, h * d)


def _prefill(q, k_cache, v_cache, chunk: _PrefillChunk, scores: Scores, sinks=None):
    """One sequence's chunk of n new tokens at the end of its cached context; causal."""
    n, h, d = q.shape
    kv = k_cache.shape[-2]
    g = h // kv
    keys = _read(k_cache, chunk.gather, 0)[0]      # [kv, ctx, d]
    values = _read(v_cache, chunk.gather, 1)[0]
    # rows ordered (group member, query position) to match the stacked queries
    qg = q.view(n, kv, g, d).permute(1, 2, 0, 3).reshape(kv, g * n, d)
    mask = chunk.masks(scores.window)
    mask = mask if g == 1 else mask.repeat(g, 1)
    if sinks is not None:   # one per stacked query row: head (kv, member), any position
        sinks = sinks.view(kv, g, 1, 1).expand(kv, g, n, 1).reshape(kv, g * n, 1)
    out = _attend(qg, keys, values, mask, scores, sinks)
    return out.view(kv, g, n, d).permute(2, 0, 1, 3).reshape(n, h * d)
