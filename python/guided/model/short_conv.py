"""LFM2's gated short convolution: the token mixer of its "conv" layers.

For each token, in_proj gives three vectors B, C and x; the layer's output is
C · conv(B·x), where conv is a causal depthwise convolution over the last
`kernel` tokens' B·x (a weight per channel and tap), then out_proj.

What the convolution reads back is per token, so it lives in the paged KV
cache like keys do: a "conv" layer's cache holds each token's B·x in the
token's slot, [blocks, block_size, 1, hidden], and a row reads its sequence's
previous `kernel - 1` slots through the block table. That is more memory than
a per-sequence window (hidden values per token, as much as an attention
layer's K and V with hidden / 2 of them), and buys every engine feature as it
is for attention: chunked prefill, preemption, the prefix cache at any token,
forced tokens and refused drafts (a slot written by a refused draft is
rewritten by the next token at that position, as its K and V are).

rust/cpu/gated_conv.rs is the CPU step's twin.
"""
from __future__ import annotations

import torch
from torch import nn

from .attention import AttentionMetadata


def previous_slots(attn: AttentionMetadata, positions: torch.Tensor, back: int) -> torch.Tensor:
    """[T, back] int64: each row's cache slots for the `back` positions before it in its
    sequence, the nearest last; -1 before the sequence's first token."""
    starts = attn.query_start_loc.to(device=positions.device, dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(len(starts) - 1, device=positions.device), starts.diff())
    before = positions.long()[:, None] - torch.arange(back, 0, -1, device=positions.device)[None, :]
    tables = attn.block_tables.to(device=positions.device, dtype=torch.long)
    kept = before.clamp(min=0)
    blocks = tables[seq[:, None], kept // attn.block_size]
    return torch.where(before >= 0, blocks * attn.block_size + kept % attn.block_size, -1)


def meta_parameter(*shape: int) -> nn.Parameter:
    """A parameter the loader assigns (made on the meta device, as decoder.py's are)."""
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


def paged_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cache: torch.Tensor,
               slots: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """A causal depthwise convolution over each sequence's tokens, the earlier ones read back
    from the paged cache: x [T, C] is written to its rows' slots first (so a row reads the rows
    before it in the same step), then convolved with `weight` [C, kernel] (taps oldest first) over
    the rows' previous slots (`previous`, nearest last; -1: before the sequence, zero). LFM2's
    convolution (Mamba-2's and DeltaNet's read whole blocks back: state_pool.py)."""
    flat = cache.view(-1, x.shape[-1])
    flat.index_copy_(0, slots, x.to(flat.dtype))
    back = previous[:, -(weight.shape[1] - 1):]
    taps = flat[back.clamp(min=0)].to(x.dtype) * (back >= 0)[..., None]                # [T, kernel - 1, C]
    w = weight.to(x.dtype)
    out = x * w[:, -1] + (taps * w[:, :-1].T[None]).sum(dim=1)
    return out if bias is None else out + bias


class ShortConv(nn.Module):
    """The convolution's weights ([hidden, kernel], a bias where the model has one) and
    the mixing between in_proj and out_proj (which the layer holds, as quantizable linears)."""

    def __init__(self, hidden: int, kernel: int, bias: bool):
        super().__init__()
        self.weight = meta_parameter(hidden, kernel)
        self.bias = meta_parameter(hidden) if bias else None

    def forward(self, bcx: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                previous: torch.Tensor) -> torch.Tensor:
        """bcx [T, 3·hidden] (in_proj's output); B·x is written to each row's slot, then each
        row is C · (its B·x and its previous slots' convolved)."""
        b, c, x = bcx.chunk(3, dim=-1)
        return c * paged_conv(b * x, self.weight, self.bias, cache, slots, previous)
