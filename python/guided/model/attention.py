"""Attention over the paged KV cache (CPU/torch path).

The cache of one layer is a pair of [num_blocks, block_size, kv_heads, head_dim]
tensors. New K/V rows are scattered in by slot id; a sequence's keys are read
back by gathering its blocks through its block-table row.

Grouped-query attention is done without copying K/V per query head: the g query
heads that share a kv head are stacked as extra query rows of that kv head, so
SDPA sees [.., kv_heads, g*Q, d] queries against [.., kv_heads, L, d] keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter the new tokens' K/V ([T, kv, d]) into their cache slots."""
    kv, d = k_cache.shape[-2:]
    k_cache.view(-1, kv, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv, d).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    attn: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, d] for the new tokens (their K/V already written). Returns [T, H*d]."""
    if attn.is_decode_only:
        return _decode(q, k_cache, v_cache, attn.block_tables, attn.context_lens,
                       attn.max_context_len, attn.block_size, scale)
    return _mixed(q, k_cache, v_cache, attn, scale)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """[B, kv, length, d]: each sequence's first `length` cached positions, in one indexing op."""
    nblocks = -(-length // block_size)
    b = block_tables.shape[0]
    kv, d = cache.shape[-2:]
    # index_select over whole blocks (contiguous rows of bs*kv*d) is several times faster than
    # advanced indexing with a 2-D index
    blocks = cache.index_select(0, block_tables[:, :nblocks].reshape(-1))
    return blocks.view(b, nblocks * block_size, kv, d)[:, :length].transpose(1, 2)


def _decode(q, k_cache, v_cache, block_tables, context_lens, max_len, block_size, scale):
    """One new token per sequence: one batched SDPA, keys past each context masked out."""
    b, h, d = q.shape
    kv = k_cache.shape[-2]
    keys = _gather(k_cache, block_tables, max_len, block_size)
    values = _gather(v_cache, block_tables, max_len, block_size)
    mask = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None].to(q.device)
    out = F.scaled_dot_product_attention(
        q.view(b, kv, h // kv, d), keys, values, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(b, h * d)


def _prefill_one(q, k_cache, v_cache, blocks, ctx, block_size, scale):
    """One sequence's chunk of Q new tokens that end its `ctx` cached tokens; causal."""
    n, h, d = q.shape
    kv = k_cache.shape[-2]
    g = h // kv
    keys = _gather(k_cache, blocks[None], ctx, block_size)[0]      # [kv, ctx, d]
    values = _gather(v_cache, blocks[None], ctx, block_size)[0]
    # rows ordered (group member, query position) to match the stacked queries
    qg = q.view(n, kv, g, d).permute(1, 2, 0, 3).reshape(kv, g * n, d)
    qpos = torch.arange(ctx - n, ctx, device=q.device)
    mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]   # [n, ctx]
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask.repeat(g, 1), scale=scale)
    return out.view(kv, g, n, d).permute(2, 0, 1, 3).reshape(n, h * d)


def _mixed(q, k_cache, v_cache, attn, scale):
    """Prefill chunks one by one; all single-token sequences together as one decode batch."""
    t, h, d = q.shape
    out = torch.empty(t, h * d, dtype=q.dtype, device=q.device)
    starts = attn.query_start_loc.tolist()
    ctx_lens = attn.context_lens.tolist()
    decode_seqs, decode_rows = [], []
    for i, ctx in enumerate(ctx_lens):
        s, e = starts[i], starts[i + 1]
        if e - s == 1:
            decode_seqs.append(i)
            decode_rows.append(s)
        elif e > s:
            out[s:e] = _prefill_one(q[s:e], k_cache, v_cache, attn.block_tables[i], ctx,
                                    attn.block_size, scale)
    if decode_seqs:
        seqs = torch.tensor(decode_seqs, device=q.device)
        rows = torch.tensor(decode_rows, device=q.device)
        lens = attn.context_lens.index_select(0, seqs.to(attn.context_lens.device))
        out[rows] = _decode(q.index_select(0, rows), k_cache, v_cache,
                            attn.block_tables.index_select(0, seqs.to(attn.block_tables.device)),
                            lens, max(ctx_lens[i] for i in decode_seqs), attn.block_size, scale)
    return out
