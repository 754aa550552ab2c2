"""Rotary position embedding: frequencies (plain, linear, llama3, LongRoPE, YaRN) and a cos/sin table.

A model has one table per rotary base its layers use ("global", and "local"
for Gemma 3's sliding layers); a head may rotate only its leading
`rotary_dim` values (Phi-4-mini, GLM).
"""
from __future__ import annotations

import math

import torch

from .config import ModelConfig


def inverse_frequencies(config: ModelConfig, freq_factors: torch.Tensor | None = None,
                        local: bool = False) -> tuple[torch.Tensor, float]:
    """The table's inverse frequencies, and the factor its cos/sin are scaled by
    (LongRoPE's and YaRN's attention factor; 1 otherwise). `local`: the sliding layers'
    own base, unscaled (Gemma 3)."""
    dim = config.rotary_dim
    theta = config.local_rope_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = {} if local else config.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif kind == "longrope":
        return _longrope(inv_freq, scaling)
    elif kind == "yarn":
        return _yarn(scaling, dim, theta, config.max_position_embeddings)
    if freq_factors is not None and not local:
        # llama.cpp stores llama3 scaling as per-frequency divisors (rope_freqs.weight)
        inv_freq = inv_freq / freq_factors.float()
    return inv_freq, 1.0


def _longrope(inv_freq: torch.Tensor, s: dict) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-frequency divisors, the long ones where the model is
    made for more than its original context. Chosen once per model, as
    llama.cpp does, so a sequence's cached keys never mix the two (transformers
    switches per forward, by the sequence's length)."""
    original = float(s["original_max_position_embeddings"])
    longest = float(s.get("max_position_embeddings") or original)
    factors = s["long_factor"] if longest > original else s["short_factor"]
    factor = float(s.get("factor") or longest / original)
    scale = s.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq / torch.tensor(factors, dtype=torch.float32), float(scale)


def _yarn(s: dict, dim: int, base: float, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN as transformers computes it (modeling_rope_utils._compute_yarn_parameters): frequencies
    that turn fewer than `beta_slow` times over the original context are slowed by `factor`, those
    that turn more than `beta_fast` times are kept, a linear ramp blends between; cos/sin are scaled
    by the attention factor (0.1·ln(factor) + 1 unless given). `truncate` rounds the ramp's ends
    outwards to whole dimensions (transformers' default; what ggml always does; gpt-oss says false).
    A GGUF's `extrapolation_factor` and `attention_multiplier` are llama.cpp's ext_factor and
    attn_factor (1 unless the file says)."""
    original = float(s["original_max_position_embeddings"])
    factor = float(s.get("factor") or max_positions / original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp) * float(s.get("extrapolation_factor", 1.0))
    # inv_freq as transformers has it: 1 / base^(i/d), and 1 / (factor · base^(i/d)) slowed
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    blended = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return blended, float(attention) * float(s.get("attention_multiplier", 1.0))


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Meta's llama3 schedule: long wavelengths slowed by `factor`, short ones kept, a blend between."""
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryTable:
    """cos/sin per position, computed once (fp32) and grown if a longer context shows up."""

    def __init__(self, inv_freq: torch.Tensor, length: int, dtype: torch.dtype, device: torch.device,
                 scale: float = 1.0):
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        self.dtype, self.device, self.scale = dtype, device, scale
        self._build(length)

    def _build(self, length: int) -> None:
        pos = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]
        # one [P, d] table holding cos in the first half and sin in the second: one gather per step
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.table = (table * self.scale if self.scale != 1.0 else table).to(self.dtype)
        self.length = length

    def ensure(self, length: int) -> None:
        if length > self.length:
            self._build(max(length, 2 * self.length))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, d/2] cos and sin for `positions`."""
        cs = self.table.index_select(0, positions).unsqueeze(1)
        return cs.chunk(2, dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves (HF/NeoX layout): [x1, x2] → [x1·cos − x2·sin, x2·cos + x1·sin],
    over the leading 2·len(cos) values of each head; the rest pass unrotated."""
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
