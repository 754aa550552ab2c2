"""Turning per-tensor weights (HF names) into the fused parameters CausalLM holds."""
from __future__ import annotations

import torch

from .config import ModelConfig
from .decoder import CausalLM
from .quant_linear import QuantEmbedding, QuantLinear, QuantWeight


#: a GGUF's 3-D expert tensors, which may stay in their blocks (moe.MoE.hold_blocks)
_EXPERT_BLOCKS = ("gate_exps", "up_exps", "down_exps")

#: the per-layer tensors CausalLM holds, by the names the loaders give them
#: (HF's for the projections; the norms by role, since "post_attention_layernorm"
#: is the MLP's input norm in Llama and the attention's output norm in Gemma)
LAYER_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj",
                           "gate_up_proj", "down_proj", "q_norm", "k_norm", "attn_norm", "mlp_norm",
                           "attn_post_norm", "mlp_post_norm", "conv_in_proj", "conv_out_proj", "conv",
                           "mamba_in_proj", "mamba_out_proj", "delta_out_proj"})
#: latent attention's (DeepSeek V3) projections and norms, held by the layer's `mla` module
MLA_MODULES = frozenset({"q_proj", "q_a_proj", "q_a_norm", "q_b_proj", "kv_a_proj", "kv_a_norm", "kv_b_proj"})
#: a recurrent mixer's convolution and norm, held by the layer's `mamba` or `delta` module
RECURRENT_MODULES = {"mamba_conv": "mamba.conv", "mamba_norm": "mamba.norm",
                     "delta_conv": "delta.conv", "delta_norm": "delta.norm"}
#: ... and its parameters (dt_bias, A_log, D), named `layers.N.<checkpoint's module>.<name>`
RECURRENT_PARAMETERS = {"mamba": "mamba", "linear_attn": "delta"}
#: per-layer parameters held by the layer itself, named `layers.N.<name>` (gpt-oss's attention sinks)
LAYER_PARAMETERS = frozenset({"sinks"})


class WeightSink:
    """Collects tensors named as LAYER_MODULES says; fuses q|k|v and gate|up as soon as a layer's parts are all in,
    so at most one layer's unfused copies are alive at a time. A linear weight may come as a
    QuantWeight (a GGUF's blocks): its layer becomes a QuantLinear."""

    _QKV = ("q_proj", "k_proj", "v_proj")
    _GATE_UP = ("gate_proj", "up_proj")
    _DELTA_IN = ("delta_in_qkv", "delta_in_z", "delta_in_b", "delta_in_a")
    _DELTA_IN_PAIRED = ("delta_in_qkvz", "delta_in_ba")

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        self.config, self.dtype, self.device = config, dtype, device
        self.state: dict[str, torch.Tensor] = {}
        self._pending: dict[str, dict[str, torch.Tensor | QuantWeight]] = {}
        #: per layer, experts' tensors by (gate_proj | up_proj | down_proj, expert), stacked at build()
        self._experts: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
        #: per layer, a GGUF's 3-D expert blocks [E, rows, row_bytes] (dtype="gguf"), by _EXPERT_BLOCKS
        self._expert_blocks: dict[str, dict[str, QuantWeight]] = {}

    def add(self, name: str, tensor: torch.Tensor | QuantWeight) -> None:
        if isinstance(tensor, torch.Tensor):
            tensor = tensor.to(device=self.device, dtype=self.dtype)
        parts = name.split(".")
        if parts[0] != "layers":
            self._add_top(name, tensor)
            return
        prefix, module, kind = ".".join(parts[:2]), parts[-2], parts[-1]
        if len(parts) == 3 and parts[2] in LAYER_PARAMETERS:
            self.state[name] = tensor
            return
        if parts[2] == "moe":
            self._add_moe(prefix, parts[3:], tensor)
            return
        if module in RECURRENT_MODULES:
            self.state[f"{prefix}.{RECURRENT_MODULES[module]}.{kind}"] = tensor
            return
        if module in RECURRENT_PARAMETERS:
            self.state[f"{prefix}.{RECURRENT_PARAMETERS[module]}.{kind}"] = tensor
            return
        if module in self._DELTA_IN:   # q|k|v, z, b, a: one projection
            self._collect(f"{prefix}.delta_in_proj.{kind}", self._DELTA_IN, module, tensor)
            return
        if module in self._DELTA_IN_PAIRED:   # Qwen3-Next's q|k|v|z and b|a, in that order already
            self._collect(f"{prefix}.delta_in_proj.{kind}", self._DELTA_IN_PAIRED, module, tensor)
            return
        if module == "norm":   # a layer's one norm (Nemotron-H's blocks): its mixer's, or its MLP's
            module = "attn_norm" if self.config.has_mixer(int(parts[1])) else "mlp_norm"
        if self.config.latent is not None and module in MLA_MODULES:
            self.state[f"{prefix}.mla.{module}.{kind}"] = tensor
            return
        if module not in LAYER_MODULES:
            raise ValueError(f"{name}: a weight this architecture's layers do not have")
        if module in ("gate_up_proj", "down_proj") and self.config.is_moe(int(parts[1])):
            # Granite's shared_mlp, a dense MLP beside the experts: their shared expert
            self.state[f"{prefix}.moe.shared_{module.removesuffix('_proj')}"] = tensor
            return
        if module in self._QKV:
            self._collect(f"{prefix}.qkv_proj.{kind}", self._QKV, module, tensor)
        elif module in self._GATE_UP and self.config.arch.ungated is None:
            self._collect(f"{prefix}.gate_up_proj.{kind}", self._GATE_UP, module, tensor)
        else:
            self.state[f"{prefix}.{module}.{kind}"] = tensor

    def _add_top(self, name: str, tensor: torch.Tensor) -> None:
        if name not in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
            raise ValueError(f"{name}: a weight this architecture does not have")
        self.state[name] = tensor

    def _add_moe(self, prefix: str, rest: list[str], tensor) -> None:
        """A mixture-of-experts tensor, as MoE holds them: `router.weight` (and
        gpt-oss's `router.bias`), `router_bias`, stacked `gate_up` [E, 2I, H] and
        `down` [E, H, I] (gpt-oss: `gate_up_bias` [E, 2I], `down_bias` [E, H]), and
        a shared expert's `shared_gate_up`/`shared_down`. They arrive per expert
        (`experts.E.gate_proj.weight`, HF checkpoints), stacked (transformers 5's
        `gate_up`/`down`), or as a GGUF's `gate_exps`/`up_exps` [E, I, H] (and
        their `gate_exps_bias`/`up_exps_bias` [E, I])."""
        if isinstance(tensor, QuantWeight) and rest[0] in _EXPERT_BLOCKS:
            self._expert_blocks.setdefault(prefix, {})[rest[0]] = tensor   # see _quant_experts
            return
        if isinstance(tensor, QuantWeight):   # a shared expert runs dense
            tensor = tensor.dense().to(device=self.device, dtype=self.dtype)
        name = f"{prefix}.moe.{'.'.join(rest)}"
        if rest[0] == "experts":
            self._experts.setdefault(prefix, {})[rest[2], int(rest[1])] = tensor
        elif rest[0] == "shared":
            self._add_shared(prefix, rest[1], rest[-1], tensor)
        elif rest[0] in ("gate_exps", "up_exps"):
            self._collect(f"{prefix}.moe.gate_up", ("gate_exps", "up_exps"), rest[0], tensor, dim=1)
        elif rest[0] in ("gate_exps_bias", "up_exps_bias"):
            self._collect(f"{prefix}.moe.gate_up_bias", ("gate_exps_bias", "up_exps_bias"), rest[0], tensor, dim=1)
        elif rest[0] == "down_exps":
            self.state[f"{prefix}.moe.down"] = tensor
        else:
            self.state[name] = tensor

    def _add_shared(self, prefix: str, module: str, kind: str, tensor) -> None:
        """A shared expert's gate_proj, up_proj or down_proj weight or bias, as MoE holds them:
        `shared_gate_up` (gate|up, or up alone where the experts have no gate), `shared_down`,
        their `_bias`es."""
        suffix = "_bias" if kind == "bias" else ""
        if module == "down_proj":
            self.state[f"{prefix}.moe.shared_down{suffix}"] = tensor
        elif self.config.moe.ungated:
            self.state[f"{prefix}.moe.shared_gate_up{suffix}"] = tensor
        else:
            self._collect(f"{prefix}.moe.shared_gate_up{suffix}", self._GATE_UP, module, tensor)

    def _stack_experts(self) -> None:
        for prefix, parts in self._experts.items():
            n = 1 + max(e for _, e in parts)
            kinds = ("up_proj", "down_proj") if self.config.moe.ungated else ("gate_proj", "up_proj", "down_proj")
            try:
                stacked = {kind: torch.stack([parts[kind, e] for e in range(n)]) for kind in kinds}
            except KeyError as missing:
                raise ValueError(f"{prefix}: expert weight {missing} is missing") from None
            self.state[f"{prefix}.moe.gate_up"] = torch.cat([stacked[k] for k in kinds[:-1]], dim=1)
            self.state[f"{prefix}.moe.down"] = stacked["down_proj"]
        self._experts.clear()

    def _collect(self, fused: str, order: tuple[str, ...], part: str, tensor, dim: int = 0) -> None:
        parts = self._pending.setdefault(fused, {})
        parts[part] = tensor
        if len(parts) == len(order):
            del self._pending[fused]
            ordered = [parts[p] for p in order]
            if all(isinstance(p, QuantWeight) for p in ordered) and dim == 0:
                joined = QuantWeight.concat(ordered)
                if joined is not None:
                    self.state[fused] = joined
                    return
            # a mix of quantized and float parts is held dense
            dense = [p.dense() if isinstance(p, QuantWeight) else p for p in ordered]
            self.state[fused] = torch.cat([d.to(device=self.device, dtype=self.dtype) for d in dense], dim=dim)

    def build(self) -> CausalLM:
        self._stack_experts()
        if self._pending:
            raise ValueError(f"incomplete weights: {sorted(self._pending)}")
        # the biases a checkpoint holds say which layers have them (a GGUF's metadata does not)
        c = self.config
        first = next((i for i in range(c.num_layers) if not c.is_conv(i)), 0)   # an attention layer
        c.attention_bias = c.attention_bias or f"layers.{first}.qkv_proj.bias" in self.state
        c.output_bias = c.output_bias or f"layers.{first}.o_proj.bias" in self.state
        c.mlp_bias = c.mlp_bias or "layers.0.gate_up_proj.bias" in self.state
        c.qk_norm = c.qk_norm or ("head" if f"layers.{first}.q_norm.weight" in self.state else None)
        if "lm_head.weight" not in self.state:
            self.state["lm_head.weight"] = self.state["embed_tokens.weight"]
            self.config.tie_word_embeddings = True
        experts = self._quant_experts()
        model = CausalLM(self.config)
        self._quant_linears(model)
        for prefix, (gate_up, down) in experts.items():
            model.get_submodule(f"{prefix}.moe").hold_blocks(
                [QuantLinear(m, False) for m in gate_up], [QuantLinear(m, False) for m in down])
        model.load_state_dict(self.state, strict=True, assign=True)
        model.eval()
        return model

    def _quant_experts(self) -> dict[str, tuple[list, list]]:
        """Per layer, each expert's gate|up and down as native matrices over its
        GGUF blocks; a layer whose gate and up differ in format is held dense."""
        held = {}
        for prefix, parts in self._expert_blocks.items():
            gate, up, down = (parts[k] for k in _EXPERT_BLOCKS)
            joined = [QuantWeight.concat([gate.expert(e), up.expert(e)]) for e in range(gate.shape[0])]
            if all(isinstance(j, QuantWeight) for j in joined):
                held[prefix] = ([j.matrix() for j in joined],
                                [down.expert(e).matrix() for e in range(down.shape[0])])
                continue
            dense = {k: torch.stack([w.expert(e).dense() for e in range(w.shape[0])])
                     for k, w in parts.items()}
            self.state[f"{prefix}.moe.gate_up"] = torch.cat([dense["gate_exps"], dense["up_exps"]], dim=1)
            self.state[f"{prefix}.moe.down"] = dense["down_exps"]
        self._expert_blocks.clear()
        return held

    def _quant_linears(self, model: CausalLM) -> None:
        """Put a QuantLinear where the state holds a QuantWeight (or a stack of them in several
        formats), a QuantEmbedding for quantized embeddings (one matrix with a head tied to them)."""
        quantized = {name: self.state.pop(name) for name, w in list(self.state.items())
                     if isinstance(w, (QuantWeight, list))}
        held: dict[int, object] = {}   # the blocks are copied into Rust once (and repacked there)
        for name, weight in quantized.items():
            if id(weight) not in held:
                held[id(weight)] = [w.matrix() for w in weight] if isinstance(weight, list) else weight.matrix()
            matrices = held[id(weight)]
            if name == "embed_tokens.weight":
                model.embed_tokens = QuantEmbedding(matrices, self.dtype)
                continue
            parent, _, child = name.removesuffix(".weight").rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            bias = getattr(owner, child).bias is not None
            setattr(owner, child, QuantLinear(matrices, bias, precise=name == "lm_head.weight"))
