"""The decoder for the Llama family: llama/SmolLM2, qwen2 (q/k/v bias), qwen3 (per-head q/k norm).

Weights are held fused (q|k|v in one matrix, gate|up in another) so a layer is
four matmuls. Parameters are created on the meta device and the loader assigns
real tensors, so nothing is initialised twice.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, AttentionPlan, paged_attention, write_kv
from .config import ModelConfig
from .rope import RotaryTable, apply_rotary, inverse_frequencies

KVCache = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, device="meta"), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def _linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=bias, device="meta")
    layer.requires_grad_(False)
    return layer


def _whole(x: torch.Tensor) -> torch.Tensor:
    return x


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.head_dim ** -0.5
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.qkv_proj = _linear(c.hidden_size, self.q_size + 2 * self.kv_size, c.attention_bias)
        self.o_proj = _linear(self.q_size, c.hidden_size, False)
        self.qk_norm = c.qk_norm
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate_up_proj = _linear(c.hidden_size, 2 * c.intermediate_size, False)
        self.down_proj = _linear(c.intermediate_size, c.hidden_size, False)
        #: the sum over tensor-parallel ranks of o_proj's and down_proj's partial outputs
        #: (set by parallel.shard; a whole model's outputs are whole already)
        self.reduce = _whole

    def forward(self, x, cos, sin, kv_cache: KVCache, plan: AttentionPlan):
        t = x.shape[0]
        qkv = self.qkv_proj(self.input_norm(x))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, plan)
        x = x + self.reduce(self.o_proj(paged_attention(q, k_cache, v_cache, plan, self.scale)))
        gate, up = self.gate_up_proj(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.reduce(self.down_proj(F.silu(gate) * up))


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device="meta")
        self.embed_tokens.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, False)
        self.rotary: RotaryTable | None = None
        #: with tensor parallelism (parallel.shard): the group, and where this rank's
        #: slice of the vocabulary (embedding and LM-head rows) starts
        self.tensor_group = None
        self.vocab_start = 0

    @property
    def num_kv_heads(self) -> int:
        """The KV heads this model holds (a tensor-parallel rank's share)."""
        return self.layers[0].num_kv_heads

    def init_rotary(self, device: torch.device, dtype: torch.dtype,
                    freq_factors: torch.Tensor | None = None) -> None:
        """Build the cos/sin table once the model's device and dtype are known."""
        length = min(self.config.max_position_embeddings, 8192)
        # angles are computed in fp32 and only the cos/sin values rounded, as transformers does
        self.rotary = RotaryTable(inverse_frequencies(self.config, freq_factors), length, dtype, device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn: AttentionMetadata) -> torch.Tensor:
        self.rotary.ensure(attn.max_context_len)
        cos, sin = self.rotary.cos_sin(positions)
        plan = AttentionPlan(attn, input_ids.device)
        x = self._embed(input_ids)
        for layer, cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, cache, plan)
        return self.norm(x)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tensor_group is None:
            return self.embed_tokens(input_ids)
        # vocabulary-parallel: rows for this rank's ids, zeros for the others', summed over ranks
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        x = self.embed_tokens(torch.where(mine, local, 0)) * mine[:, None]
        return self.tensor_group.all_reduce(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 [R, V]; with tensor parallelism the whole vocabulary's on
        rank 0 and None on the other ranks."""
        logits = self.lm_head(hidden).float()
        return logits if self.tensor_group is None else self.tensor_group.gather_vocab(logits)


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype, device,
                      num_kv_heads: int | None = None) -> list[KVCache]:
    """Zeroed K and V tensors per layer. On the CPU the zeros come from
    calloc (numpy), whose pages the OS maps on first write: a large pool
    costs nothing until it is used, where writing zeros into it took seconds."""
    shape = (num_blocks, block_size, num_kv_heads or config.num_kv_heads, config.head_dim)
    return [(_zeros(shape, dtype, device), _zeros(shape, dtype, device))
            for _ in range(config.num_layers)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros((*shape[:-1], shape[-1] * size), dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype)
