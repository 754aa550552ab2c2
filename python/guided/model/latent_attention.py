"""Multi-head latent attention (MLA: DeepSeek V3, Kimi K2, GLM-4.7-Flash).

Keys and values are not cached per head: each token's cache entry is its
compressed latent c (kv_lora_rank values, after kv_a_layernorm) and one
rotary key k_rot shared by all heads (qk_rope_head_dim values), 576 values
a token and layer for DeepSeek V3, where its 128 heads' K and V would be
40960. Head h's key is [c·W_UKₕ, k_rot] and its value c·W_UVₕ, with W_UK and
W_UV the two halves of kv_b_proj.

Attention runs with the weights absorbed, as MLA's serving engines do: the
query's non-rotary part is taken into the latent space (q·W_UKₕᵀ), so a head
scores [q_lat, q_rot]·[c, k_rot] against the cached entries directly, and
its output, a weighted sum of latents, leaves through W_UVₕ. That is
grouped-query attention with one KV head whose head is the cache entry:
the paged attention every layer uses runs it unchanged (the entry is the
value too; the rotary part of the weighted sum is dropped), so windows,
prefix caching, chunking, preemption and drafts hold as for any layer. It
equals transformers' expand-then-attend to float rounding.
"""
from __future__ import annotations

import torch
from torch import nn

from .layer_kinds import LatentConfig
from .attention import AttentionPlan, Scores, paged_attention
from .rope import apply_rotary


def _linear(n_in: int, n_out: int) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=False, device="meta")
    layer.requires_grad_(False)
    return layer


class LatentAttention(nn.Module):
    """The projections up to the cache and the absorbed attention; o_proj is the layer's."""

    def __init__(self, m: LatentConfig, hidden: int, heads: int, eps: float, scale: float, norm):
        super().__init__()
        self.m, self.heads = m, heads
        q_width = heads * (m.nope_dim + m.rope_dim)
        if m.q_lora_rank:
            self.q_a_proj, self.q_b_proj = _linear(hidden, m.q_lora_rank), _linear(m.q_lora_rank, q_width)
            self.q_a_norm = norm(m.q_lora_rank, eps)
        else:
            self.q_proj = _linear(hidden, q_width)
        self.kv_a_proj = _linear(hidden, m.kv_lora_rank + m.rope_dim)
        self.kv_a_norm = norm(m.kv_lora_rank, eps)
        #: [heads · (nope + v), kv_lora_rank]: W_UK and W_UV per head, used absorbed
        self.kv_b_proj = _linear(m.kv_lora_rank, heads * (m.nope_dim + m.v_dim))
        self.scores = Scores(scale)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cache: torch.Tensor,
                plan: AttentionPlan) -> torch.Tensor:
        """x [T, hidden] → [T, heads · v_dim], each token's entry written to `cache`
        ([blocks, block_size, 1, kv_lora_rank + rope_dim]) first."""
        m, t = self.m, x.shape[0]
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))) if m.q_lora_rank else self.q_proj(x)
        q_nope, q_rot = q.view(t, self.heads, -1).split([m.nope_dim, m.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj(x).split([m.kv_lora_rank, m.rope_dim], dim=-1)
        cos, sin = rotary                                            # [T, 1, rope_dim / 2]
        k_rot = apply_rotary(k_rot.view(t, 1, m.rope_dim), cos, sin).view(t, m.rope_dim)
        entry = torch.cat([self.kv_a_norm(latent), k_rot], dim=-1)
        cache.view(-1, entry.shape[-1]).index_copy_(0, plan.slot_mapping, entry.to(cache.dtype))
        query_rot = apply_rotary(q_rot.contiguous(), cos, sin)
        w = self.kv_b_proj.weight.view(self.heads, m.nope_dim + m.v_dim, m.kv_lora_rank)
        q_lat = torch.einsum("thn,hnl->thl", q_nope, w[:, :m.nope_dim])
        query = torch.cat([q_lat, query_rot], dim=-1)
        out = paged_attention(query, cache, cache, plan, self.scores).view(t, self.heads, -1)
        return torch.einsum("thl,hvl->thv", out[..., :m.kv_lora_rank], w[:, m.nope_dim:]).reshape(t, -1)
