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

rust/short_conv.rs is the CPU step's twin.
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


class ShortConv(nn.Module):
    """The convolution's weights ([hidden, kernel], a bias where the model has one) and
    the mixing between in_proj and out_proj (which the layer holds, as quantizable linears)."""

    def __init__(self, hidden: int, kernel: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, kernel, device="meta"), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden, device="meta"), requires_grad=False) if bias else None

    def forward(self, bcx: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                previous: torch.Tensor) -> torch.Tensor:
        """bcx [T, 3·hidden] (in_proj's output); B·x is written to each row's slot, then each
        row is C · (its B·x and its previous slots' convolved)."""
        b, c, x = bcx.chunk(3, dim=-1)
        bx = b * x
        flat = cache.view(-1, bx.shape[-1])
        flat.index_copy_(0, slots, bx.to(flat.dtype))
        previous = previous[:, -(self.weight.shape[1] - 1):]
        taps = flat[previous.clamp(min=0)].to(bx.dtype) * (previous >= 0)[..., None]   # [T, kernel - 1, hidden]
        w = self.weight.to(bx.dtype)
        mixed = bx * w[:, -1] + (taps * w[:, :-1].T[None]).sum(dim=1)
        if self.bias is not None:
            mixed = mixed + self.bias
        return c * mixed
