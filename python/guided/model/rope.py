"""Rotary position embedding: frequencies (plain, linear, llama3) and a cos/sin table."""
from __future__ import annotations

import math

import torch

from .config import ModelConfig


def inverse_frequencies(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    if freq_factors is not None:
        # llama.cpp stores llama3 scaling as per-frequency divisors (rope_freqs.weight)
        inv_freq = inv_freq / freq_factors.float()
    return inv_freq


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

    def __init__(self, inv_freq: torch.Tensor, length: int, dtype: torch.dtype, device: torch.device):
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        self.dtype, self.device = dtype, device
        self._build(length)

    def _build(self, length: int) -> None:
        pos = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]
        # one [P, d] table holding cos in the first half and sin in the second: one gather per step
        self.table = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(self.dtype)
        self.length = length

    def ensure(self, length: int) -> None:
        if length > self.length:
            self._build(max(length, 2 * self.length))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, d/2] cos and sin for `positions`."""
        cs = self.table.index_select(0, positions).unsqueeze(1)
        return cs.chunk(2, dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves (HF/NeoX layout): [x1, x2] → [x1·cos − x2·sin, x2·cos + x1·sin]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
