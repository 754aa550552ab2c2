"""Granite 4.0-H's Mamba-2 mixer, and the pool of per-sequence states it keeps.

A "mamba" layer projects each token to a gate z, the convolution's input
x|B|C and a step size dt per head; a causal depthwise convolution (then SiLU)
mixes x|B|C over the last `conv_kernel` tokens; then each head h carries a
state S [head_dim, state_size] through the tokens:

    S ← exp(dtₕ·Aₕ)·S + dtₕ·x ⊗ B,    y = S·C + Dₕ·x,

and y leaves through an RMSNorm gated by SiLU(z) (per group) and out_proj.

What each part keeps between steps:
- the paged cache keeps each token's convolution input x|B|C and its dt
  ([blocks, block_size, 1, conv_dim + heads]), read through the block table;
- S is a function of the whole prefix and does not fit a token: it lives in
  a slot of the sequence's own (state_pool.py), at the last block boundary
  the sequence passed; a step computes each block it touches whole from there
  and the block's tokens in the cache (the chunked form below), and the states
  at boundaries serve the prefix cache as snapshots.

So continuous batching, chunked prefill, preemption (by recompute), the prefix
cache (at snapshots) and speculative decoding (refused drafts roll back) hold,
and a row's numbers do not depend on how its rows came into steps.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layer_kinds import MambaConfig
from .short_conv import meta_parameter as _parameter
from .state_pool import StateStep, segment_decay


class GatedNorm(nn.Module):
    """RMSNorm of y·SiLU(z) ("gated") or RMSNorm(y)·SiLU(z) ("norm_then_gate"), per group of
    `group` channels (Mamba-2's norm before out_proj)."""

    def __init__(self, dim: int, group: int, eps: float, placement: str = "gated"):
        super().__init__()
        self.weight, self.group, self.eps, self.placement = _parameter(dim), group, eps, placement

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gated = self.placement == "gated"
        h = (y.float() * F.silu(z.float()) if gated else y.float()).unflatten(-1, (-1, self.group))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if gated:
            return self.weight * h.flatten(-2).to(y.dtype)
        return (self.weight * h.flatten(-2) * F.silu(z.float())).to(y.dtype)


class Mamba2(nn.Module):
    """The mixer between in_proj and out_proj (which the layer holds, as quantizable linears)."""

    def __init__(self, m: MambaConfig, index: int, eps: float):
        super().__init__()
        self.m = m
        #: this layer's row of the StatePool
        self.index = index
        self.conv = nn.Module()
        self.conv.weight = _parameter(m.conv_dim, m.conv_kernel)
        self.conv.bias = _parameter(m.conv_dim) if m.conv_bias else None
        self.dt_bias, self.A_log, self.D = _parameter(m.heads), _parameter(m.heads), _parameter(m.heads)
        #: y's norm and gate (Falcon-H1 may have no norm: y·SiLU(z))
        self.norm = GatedNorm(m.inner, m.inner // m.groups, eps, m.norm) if m.norm != "none" else None

    def forward(self, projected: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                states: StateStep) -> torch.Tensor:
        m = self.m
        z, xbc, dt = projected.split([m.inner, m.conv_dim, m.heads], dim=-1)
        # each row's convolution input and dt into its slot: the blocks are computed from there
        flat = cache.view(-1, cache.shape[-1])
        flat.index_copy_(0, slots, torch.cat([xbc, dt], dim=-1).to(flat.dtype))
        y = self._scan(flat, states).flatten(-2).to(projected.dtype)
        return self.norm(y, z) if self.norm is not None else (y.float() * F.silu(z.float())).to(y.dtype)

    def _scan(self, flat: torch.Tensor, s: StateStep) -> torch.Tensor:
        """The step's rows' y [T, heads, head_dim], the blocks they fall in computed whole
        (state_pool.Segment) from the state at each block's start, sequences side by side.
        Within a block, with a_t = dt_t·A and Λ_t = a_1 + … + a_t:

            y_t = e^Λ_t·S₀·C_t + Σ_{s≤t} e^(Λ_t − Λ_s)·dt_s·(C_t·B_s)·x_s + D·x_t,
            S_L = e^Λ_L·S₀ + Σ_s e^(Λ_L − Λ_s)·dt_s·x_s ⊗ B_s

        (Mamba-2's chunked form, "SSD"); the block's positions not computed yet have dt = 0,
        which leaves S as it is and adds nothing to the rows before them."""
        m = self.m
        per_group = m.heads // m.groups
        weight, bias = self.conv.weight.float(), self.conv.bias
        a = -torch.exp(self.A_log.float())
        d_skip = self.D.float()[:, None]
        y = torch.zeros(s.rows, m.heads, m.head_dim, device=flat.device)

        def update(seg, st):                                           # st [n, H, P, N]
            win = flat[seg.window.clamp(min=0)].float() * (seg.window >= 0)[..., None]   # [n, K-1+L, width]
            conv = (win[..., :m.conv_dim].unfold(1, m.conv_kernel, 1) * weight).sum(-1)  # [n, L, conv_dim]
            conv = conv if bias is None else conv + bias.float()
            x, b, c = F.silu(conv).split([m.inner, m.groups * m.state_size, m.groups * m.state_size], dim=-1)
            raw = win[:, m.conv_kernel - 1:, m.conv_dim:]
            d = F.softplus(raw + self.dt_bias.float()).clamp(m.dt_min, m.dt_max) * seg.valid[..., None]
            x = x.unflatten(-1, (m.heads, m.head_dim))                              # [n, L, H, P]
            b = b.unflatten(-1, (m.groups, m.state_size)).repeat_interleave(per_group, dim=2)   # [n, L, H, N]
            c = c.unflatten(-1, (m.groups, m.state_size)).repeat_interleave(per_group, dim=2)
            lam = (d * a).cumsum(1)
            decay = segment_decay(lam)                                 # [n, H, t, s]
            w = torch.einsum("nthk,nshk->nhts", c, b) * decay * d.transpose(1, 2)[:, :, None]
            out = torch.einsum("nthk,nhpk->nthp", c, st) * lam.exp()[..., None] \
                + torch.einsum("nhts,nshp->nthp", w, x) + d_skip * x
            mine = seg.rows >= 0
            y[seg.rows[mine]] = out[mine]
            if not seg.whole:
                return st                                              # no block made whole: no new state
            last = lam[:, -1:]                                         # [n, 1, H]
            into = ((last - lam).exp() * d)[..., None] * x             # [n, L, H, P]
            return st * last[:, 0, :, None, None].exp() + torch.einsum("nshp,nshk->nhpk", into, b)
        s.pool.carry(self.index, s, update)
        return y
