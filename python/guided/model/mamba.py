"""Granite 4.0-H's Mamba-2 mixer, and the pool of per-sequence states it keeps.

A "mamba" layer projects each token to a gate z, the convolution's input
x|B|C and a step size dt per head; a causal depthwise convolution (then SiLU)
mixes x|B|C over the last `conv_kernel` tokens; then each head h carries a
state S [head_dim, state_size] through the tokens:

    S ← exp(dtₕ·Aₕ)·S + dtₕ·x ⊗ B,    y = S·C + Dₕ·x,

and y leaves through an RMSNorm gated by SiLU(z) (per group) and out_proj.

What each part keeps between steps:
- the convolution reads tokens back, so its inputs live in the paged cache
  per token ([blocks, block_size, 1, conv_dim]), read through the block
  table as LFM2's are (short_conv.previous_slots);
- S is a function of the whole prefix and does not fit a token: it lives in
  a slot of the sequence's own (state_pool.py), copied at block boundaries
  into the snapshots that let the prefix cache serve later requests.

So continuous batching, chunked prefill, preemption (by recompute), the
prefix cache (at snapshots) and speculative decoding (a verify step keeps S
after each drafted row; refused drafts roll back to it) hold.

The recurrence runs a segment at a time (state_pool.Segment: rows between
cuts at multiples of 64 positions and at copied states, sequences of equal
segment lengths side by side) in Mamba-2's chunked form, a decoding row in the
recurrence itself; transformers' chunked scan gives the same values to float
rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layer_kinds import MambaConfig
from .short_conv import meta_parameter as _parameter, paged_conv
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
                previous: torch.Tensor, states: StateStep) -> torch.Tensor:
        m = self.m
        z, xbc, dt = projected.split([m.inner, m.conv_dim, m.heads], dim=-1)
        mixed = paged_conv(xbc, self.conv.weight, self.conv.bias, cache, slots, previous)
        x, b, c = F.silu(mixed).split([m.inner, m.groups * m.state_size, m.groups * m.state_size], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(m.dt_min, m.dt_max)
        y = self._scan(x.float().unflatten(-1, (m.heads, m.head_dim)), dt, b.float(), c.float(), states)
        y = y.flatten(-2).to(projected.dtype)
        return self.norm(y, z) if self.norm is not None else (y.float() * F.silu(z.float())).to(y.dtype)

    def _scan(self, x, dt, b, c, s: StateStep) -> torch.Tensor:
        """The recurrence over each sequence's segments (state_pool.Segment), sequences side by
        side. Within a segment of L rows, with a_t = dt_t·A and Λ_t = a_1 + … + a_t:

            y_t = e^Λ_t·S₀·C_t + Σ_{s≤t} e^(Λ_t − Λ_s)·dt_s·(C_t·B_s)·x_s + D·x_t,
            S_L = e^Λ_L·S₀ + Σ_s e^(Λ_L − Λ_s)·dt_s·x_s ⊗ B_s

        (Mamba-2's chunked form, "SSD"); padding rows have dt = 0, which leaves S as it is."""
        m = self.m
        per_group = m.heads // m.groups
        b = b.unflatten(-1, (m.groups, m.state_size)).repeat_interleave(per_group, dim=1)   # [T, H, N]
        c = c.unflatten(-1, (m.groups, m.state_size)).repeat_interleave(per_group, dim=1)
        a = -torch.exp(self.A_log.float())
        d_skip = self.D.float()[:, None]
        y = torch.empty_like(x)

        def update(rows, valid, st):                                   # rows [n, L], st [n, H, P, N]
            if rows.shape[1] == 1:                                     # one row each (decoding): the recurrence
                r = rows[:, 0]
                d = dt[r]
                st = st * torch.exp(d * a)[..., None, None] + (d[..., None] * x[r])[..., None] * b[r][:, :, None]
                y[r] = (st @ c[r][..., None]).squeeze(-1) + d_skip * x[r]
                return st
            d = dt[rows] * valid[..., None]                            # [n, L, H]
            xs, bs, cs = x[rows], b[rows], c[rows]
            lam = (d * a).cumsum(1)
            decay = segment_decay(lam)                                 # [n, H, t, s]
            w = torch.einsum("nthk,nshk->nhts", cs, bs) * decay * d.transpose(1, 2)[:, :, None]
            out = torch.einsum("nthk,nhpk->nthp", cs, st) * lam.exp()[..., None] \
                + torch.einsum("nhts,nshp->nthp", w, xs) + d_skip * xs
            y[rows[valid]] = out[valid]
            last = lam[:, -1:]                                         # [n, 1, H]
            into = (last - lam).exp() * d                              # [n, L, H]
            return st * last[:, 0, :, None, None].exp() + torch.einsum("nsh,nshp,nshk->nhpk", into, xs, bs)
        s.pool.carry(self.index, s, update)
        return y

