"""Turning per-tensor weights (HF names) into the fused parameters CausalLM holds."""
from __future__ import annotations

import torch

from .config import ModelConfig
from .llama import CausalLM


class WeightSink:
    """Collects HF-named tensors; fuses q|k|v and gate|up as soon as a layer's parts are all in,
    so at most one layer's unfused copies are alive at a time."""

    _QKV = ("q_proj", "k_proj", "v_proj")
    _GATE_UP = ("gate_proj", "up_proj")

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        self.config, self.dtype, self.device = config, dtype, device
        self.state: dict[str, torch.Tensor] = {}
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.to(device=self.device, dtype=self.dtype)
        name = name.removeprefix("model.")
        parts = name.split(".")
        if parts[0] != "layers":
            self._add_top(name, tensor)
            return
        prefix, module, kind = ".".join(parts[:2]), parts[-2], parts[-1]
        if module in self._QKV:
            self._collect(f"{prefix}.qkv_proj.{kind}", self._QKV, module, tensor)
        elif module in self._GATE_UP:
            self._collect(f"{prefix}.gate_up_proj.{kind}", self._GATE_UP, module, tensor)
        else:
            self.state[f"{prefix}.{_LAYER_RENAMES.get(module, module)}.{kind}"] = tensor

    def _add_top(self, name: str, tensor: torch.Tensor) -> None:
        if name in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
            self.state[name] = tensor
        # anything else (rotary inv_freq buffers, unused extras) is not a weight we hold

    def _collect(self, fused: str, order: tuple[str, ...], part: str, tensor: torch.Tensor) -> None:
        parts = self._pending.setdefault(fused, {})
        parts[part] = tensor
        if len(parts) == len(order):
            self.state[fused] = torch.cat([parts[p] for p in order], dim=0)
            del self._pending[fused]

    def build(self) -> CausalLM:
        if self._pending:
            raise ValueError(f"incomplete weights: {sorted(self._pending)}")
        if "lm_head.weight" not in self.state:
            self.state["lm_head.weight"] = self.state["embed_tokens.weight"]
            self.config.tie_word_embeddings = True
        model = CausalLM(self.config)
        model.load_state_dict(self.state, strict=True, assign=True)
        model.eval()
        return model


_LAYER_RENAMES = {
    "input_layernorm": "input_norm",
    "post_attention_layernorm": "post_norm",
}
