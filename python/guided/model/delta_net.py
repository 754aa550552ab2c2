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
and b and a per token in the paged cache, S at the last block boundary passed
in a slot of the StatePool (state_pool.py), each block computed whole from
there, snapshots serving the prefix cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layer_kinds import DeltaNetConfig
from .short_conv import meta_parameter as _parameter
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
                states: StateStep) -> torch.Tensor:
        d = self.d
        qkv, z, b, a = projected.split([d.conv_dim, d.value_dim, d.v_heads, d.v_heads], dim=-1)
        # each row's convolution input, b and a into its slot: the blocks are computed from there
        flat = cache.view(-1, cache.shape[-1])
        flat.index_copy_(0, slots, torch.cat([qkv, b, a], dim=-1).to(flat.dtype))
        o = self._scan(flat, states)                                   # [T, H, V]
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm.weight.float()
        return (o * F.silu(z.float().view(-1, d.v_heads, d.v_dim))).flatten(-2).to(projected.dtype)

    def _scan(self, flat: torch.Tensor, s: StateStep) -> torch.Tensor:
        """The step's rows' o [T, v_heads, v_dim], the blocks they fall in computed whole
        (state_pool.Segment) from the state at each block's start, sequences side by side.
        Within a block, with Γ_t = g_1 + … + g_t and u_s the rows' corrections
        β_s·(v_s − (e^g_s·S_{s−1})ᵀk_s), unrolled:

            (I + A)·U = β·(V − e^Γ·K·S₀),   A_ts = β_t·e^(Γ_t − Γ_s)·k_t·k_s (s < t),
            o_t = e^Γ_t·S₀ᵀq_t + Σ_{s≤t} e^(Γ_t − Γ_s)·(q_t·k_s)·u_s,
            S_L = e^Γ_L·S₀ + Σ_s e^(Γ_L − Γ_s)·k_s ⊗ u_s

        (the chunked gated delta rule); the block's positions not computed yet have β = g = 0,
        which leaves S as it is and adds nothing to the rows before them."""
        d = self.d
        group, kernel = d.v_heads // d.k_heads, d.conv_kernel
        weight = self.conv.weight.float()
        decay_rate = -torch.exp(self.A_log.float())
        o = torch.zeros(s.rows, d.v_heads, d.v_dim, device=flat.device)

        def update(seg, st):                                           # st [n, H, K, V]
            win = flat[seg.window.clamp(min=0)].float() * (seg.window >= 0)[..., None]   # [n, K-1+L, width]
            mixed = F.silu((win[..., :d.conv_dim].unfold(1, kernel, 1) * weight).sum(-1))
            q, k, v = mixed.split([d.key_dim, d.key_dim, d.value_dim], dim=-1)
            n, length = q.shape[:2]
            q, k = (F.normalize(x.view(n, length, d.k_heads, d.k_dim), dim=-1, eps=1e-6) for x in (q, k))
            # each value head's key head: in groups (the checkpoints' order) or tiled (llama.cpp's)
            q, k = (x.repeat(1, 1, group, 1) if d.tiled else x.repeat_interleave(group, dim=2) for x in (q, k))
            q, vs = q * d.k_dim ** -0.5, v.view(n, length, d.v_heads, d.v_dim)
            raw = win[:, kernel - 1:, d.conv_dim:]
            valid = seg.valid[..., None]
            bt = torch.sigmoid(raw[..., :d.v_heads]) * valid                          # [n, L, H]
            gam = (decay_rate * F.softplus(raw[..., d.v_heads:] + self.dt_bias.float()) * valid).cumsum(1)
            decay = segment_decay(gam)                                 # [n, H, t, s]
            a = (torch.einsum("nthk,nshk->nhts", k, k) * decay * bt.transpose(1, 2)[..., None]).tril(-1)
            rhs = bt[..., None] * (vs - gam.exp()[..., None] * torch.einsum("nthk,nhkv->nthv", k, st))
            eye = torch.eye(a.shape[-1], device=a.device)
            u = torch.linalg.solve_triangular(a + eye, rhs.transpose(1, 2), upper=False, unitriangular=True)
            out = gam.exp()[..., None] * torch.einsum("nthk,nhkv->nthv", q, st) \
                + torch.einsum("nhts,nhsv->nthv", torch.einsum("nthk,nshk->nhts", q, k) * decay, u)
            mine = seg.rows >= 0
            o[seg.rows[mine]] = out[mine]
            if not seg.whole:
                return st                                              # no block made whole: no new state
            last = gam[:, -1:]
            into = (last - gam).exp().transpose(1, 2)[..., None] * u    # [n, H, L, V]
            return st * last[:, 0, :, None, None].exp() + torch.einsum("nshk,nhsv->nhkv", k, into)
        s.pool.carry(self.index, s, update)
        return o
