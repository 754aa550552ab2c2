"""Qwen3.5's and Qwen3-Next's Gated DeltaNet: the token mixer of their "delta" layers.

in_proj gives each token q|k|v (through a causal depthwise convolution of
`conv_kernel` taps, then SiLU), a gate z, and per value head b and a. With q
and k L2-normed (q also scaled by 1/√k_dim), β = σ(b) and the decay
g = −exp(A_log)·softplus(a + dt_bias), each value head carries a state
S [k_dim, v_dim] through the tokens (the key heads shared by groups of value
heads):

    S ← exp(g)·S,    S ← S + k ⊗ β·(v − Sᵀk),    o = Sᵀq,

and o leaves through an RMSNorm per head times SiLU(z), and out_proj.

What it keeps between steps is Mamba-2's (mamba.py): the convolution's inputs
per token in the paged cache, S in a slot of the StatePool (state_pool.py),
snapshots of it serving the prefix cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layer_kinds import DeltaNetConfig
from .short_conv import meta_parameter as _parameter, paged_conv
from .state_pool import StateStep, segment_decay


def delta_ungrouped(w: torch.Tensor, d: DeltaNetConfig, projection: str) -> torch.Tensor:
    """Qwen3-Next's in_proj_qkvz ("qkvz") or in_proj_ba ("ba") rows, grouped per key head
    as [q_h, k_h, v_g, z_g] or [b_g, a_g] (g: the value heads sharing key head h), in
    Qwen3.5's order: q|k|v|z or b|a, each over all heads."""
    share = d.v_heads // d.k_heads
    sizes = [d.k_dim, d.k_dim, share * d.v_dim, share * d.v_dim] if projection == "qkvz" else [share, share]
    parts = w.reshape(d.k_heads, sum(sizes), w.shape[-1]).split(sizes, dim=1)
    return torch.cat([p.reshape(-1, w.shape[-1]) for p in parts])


class DeltaNet(nn.Module):
    """The mixer between in_proj (q|k|v, z, b, a: the layer's) and out_proj (the layer's)."""

    def __init__(self, d: DeltaNetConfig, index: int, eps: float):
        super().__init__()
        self.d, self.index, self.eps = d, index, eps
        self.conv = nn.Module()
        self.conv.weight = _parameter(d.conv_dim, d.conv_kernel)
        self.dt_bias, self.A_log = _parameter(d.v_heads), _parameter(d.v_heads)
        self.norm = nn.Module()
        self.norm.weight = _parameter(d.v_dim)

    def forward(self, projected: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                previous: torch.Tensor, states: StateStep) -> torch.Tensor:
        d = self.d
        qkv, z, b, a = projected.split([d.conv_dim, d.value_dim, d.v_heads, d.v_heads], dim=-1)
        mixed = F.silu(paged_conv(qkv, self.conv.weight, None, cache, slots, previous)).float()
        q, k, v = mixed.split([d.key_dim, d.key_dim, d.value_dim], dim=-1)
        t, group = q.shape[0], d.v_heads // d.k_heads
        q, k = (F.normalize(x.view(t, d.k_heads, d.k_dim), dim=-1, eps=1e-6) for x in (q, k))
        # each value head's key head: in groups (the checkpoints' order) or tiled (llama.cpp's)
        q, k = (x.repeat(1, group, 1) if d.tiled else x.repeat_interleave(group, dim=1) for x in (q, k))
        beta = torch.sigmoid(b.float())
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        o = self._scan(q * d.k_dim ** -0.5, k, v.view(t, d.v_heads, d.v_dim), beta, g, states)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm.weight.float()
        return (o * F.silu(z.float().view(t, d.v_heads, d.v_dim))).flatten(-2).to(projected.dtype)

    def _scan(self, q, k, v, beta, g, s: StateStep) -> torch.Tensor:
        """The delta rule over each sequence's segments (state_pool.Segment), sequences side by
        side. Within a segment, with Γ_t = g_1 + … + g_t and u_s the rows' corrections
        β_s·(v_s − (e^g_s·S_{s−1})ᵀk_s), unrolled:

            (I + A)·U = β·(V − e^Γ·K·S₀),   A_ts = β_t·e^(Γ_t − Γ_s)·k_t·k_s (s < t),
            o_t = e^Γ_t·S₀ᵀq_t + Σ_{s≤t} e^(Γ_t − Γ_s)·(q_t·k_s)·u_s,
            S_L = e^Γ_L·S₀ + Σ_s e^(Γ_L − Γ_s)·k_s ⊗ u_s

        (the chunked gated delta rule); padding rows have β = g = 0, which leaves S as it is."""
        o = torch.empty_like(v)

        def update(rows, valid, st):                                   # rows [n, L], st [n, H, K, V]
            if rows.shape[1] == 1:                                     # one row each (decoding): the rule itself
                r = rows[:, 0]
                st = st * torch.exp(g[r])[..., None, None]
                delta = (v[r] - (st * k[r][..., None]).sum(-2)) * beta[r][..., None]
                st = st + k[r][..., None] * delta[..., None, :]
                o[r] = (st * q[r][..., None]).sum(-2)
                return st
            bt, gs = beta[rows] * valid[..., None], g[rows] * valid[..., None]   # [n, L, H]
            qs, ks, vs = q[rows], k[rows], v[rows]
            gam = gs.cumsum(1)
            decay = segment_decay(gam)                                 # [n, H, t, s]
            a = (torch.einsum("nthk,nshk->nhts", ks, ks) * decay * bt.transpose(1, 2)[..., None]).tril(-1)
            rhs = bt[..., None] * (vs - gam.exp()[..., None] * torch.einsum("nthk,nhkv->nthv", ks, st))
            eye = torch.eye(a.shape[-1], device=a.device)
            u = torch.linalg.solve_triangular(a + eye, rhs.transpose(1, 2), upper=False, unitriangular=True)
            out = gam.exp()[..., None] * torch.einsum("nthk,nhkv->nthv", qs, st) \
                + torch.einsum("nhts,nhsv->nthv", torch.einsum("nthk,nshk->nhts", qs, ks) * decay, u)
            o[rows[valid]] = out[valid]
            last = gam[:, -1:]
            into = (last - gam).exp()                                  # [n, L, H]
            return st * last[:, 0, :, None, None].exp() + torch.einsum("nsh,nshk,nhsv->nhkv", into, ks, u)
        s.pool.carry(self.index, s, update)
        return o
