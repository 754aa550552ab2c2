"""The CPU step in native code: the loaded model handed to rust/cpu/native_step.rs.

On a CPU, a step's every layer (norms, q/k/v, q/k norms, rotation, the KV
write, paged attention or LFM2's short convolution, the output projection,
residuals, the MLP or its experts) runs in one native call with the GIL released, over the packed
quantized kernels (rust/cpu/packed.rs) or float32 weights. The decoder reads the
model as decoder.py holds it, and what differs between architectures as data
from the architecture's row (norm placement, q/k norms, activation,
multipliers, soft-caps, windows, sinks, rotary tables), so every architecture
that loads runs on it. decoder.py (torch) stays the CUDA path and the
reference this one is tested against (``LLM(cpu_step="torch")``).

``native_decoder`` says why a model cannot run natively (bf16 weights packed
for oneDNN, tensor parallelism, another device) rather than guessing.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .. import _native
from .cpu_linear import PackedLinear
from .decoder import CausalLM, DecoderLayer
from .moe import MoE
from .quant_linear import QuantEmbedding, QuantLinear

#: LLM(cpu_step=...): "auto" runs natively where the model can, "native" insists, "torch" keeps decoder.py
CPU_STEPS = ("auto", "native", "torch")


class NotNative(ValueError):
    """The model cannot run on the native CPU step; the message says why."""


class NativeStep:
    """A model's CPU step: ``forward(plan)`` gives the logits of the rows that
    sample, float32 [R, V], and writes every row's K/V into the caches."""

    def __init__(self, model: CausalLM, caches: list[tuple[torch.Tensor, torch.Tensor]]):
        self.model = model
        #: the rotary tables in the order the layers name them
        self.kinds = sorted(model.rotary)
        self._tables: list[np.ndarray] = []   # numpy views of the tables, renewed when one grows
        self.decoder = _native.CpuDecoder(
            _spec(model), _embedding(model), [_layer(layer, self.kinds) for layer in model.layers],
            _array(model.norm.weight), _linear(model.lm_head, precise=_precise(model.lm_head)),
            [(_cache(k), _cache(v)) for k, v in caches])

    def forward(self, plan) -> np.ndarray:
        rotary = [self.model.rotary[kind] for kind in self.kinds]
        if any(t.length < plan.max_context_len for t in rotary) or len(self._tables) != len(rotary):
            for t in rotary:
                t.ensure(plan.max_context_len)
            self._tables = [t.table.numpy() for t in rotary]
        return self.decoder.forward(plan, self._tables)


def native_decoder(model: nn.Module, device: torch.device, caches) -> NativeStep:
    """The native step for `model`, or NotNative saying why it cannot run there."""
    if device.type != "cpu":
        raise NotNative(f"the native step runs on the CPU, not {device}")
    if getattr(model, "tensor_group", None) is not None:
        raise NotNative("a tensor-parallel rank runs decoder.py")
    if model.config.mamba is not None or model.config.delta is not None:
        raise NotNative("recurrent layers (Granite 4.0-H's Mamba-2, Qwen3.5's Gated DeltaNet) have no native step yet")
    if model.config.arch.ungated is not None:
        raise NotNative("an MLP without a gate (Nemotron-H) has no native step yet")
    if model.config.arch.attention_gate:
        raise NotNative("gated attention (Qwen3.5) has no native step yet")
    if model.config.latent is not None:
        raise NotNative("multi-head latent attention (DeepSeek V3, Kimi K2, GLM-4.7-Flash) has no native step yet")
    if _native.quant_kernels() is None:
        raise NotNative("this CPU has no build of the native kernels (x86-64 with AVX2 needed)")
    packed = [name for name, m in model.named_modules() if isinstance(m, PackedLinear)]
    if packed:
        raise NotNative("bfloat16 weights packed for oneDNN (an HF model on a bf16 CPU, or dtype=\"bfloat16\"): "
                        "the native step takes GGUF blocks or float32 weights")
    floats = {p.dtype for p in model.parameters() if p.device.type != "meta"}
    if floats - {torch.float32}:
        raise NotNative(f"weights in {', '.join(sorted(map(str, floats - {torch.float32})))}: "
                        "the native step takes GGUF blocks or float32 weights")
    if any(k.dtype != torch.float32 for k, _ in caches):
        raise NotNative("the native step keeps its KV cache in float32")
    return NativeStep(model, caches)


def _spec(model: CausalLM) -> _native.NativeSpec:
    c = model.config
    arch = c.arch
    return _native.NativeSpec(
        hidden=c.hidden_size, heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        rotary_dim=c.rotary_dim, eps=float(c.rms_norm_eps), norms=arch.norms, norm_kind=arch.norm_kind,
        qk_norm=c.qk_norm, qk_norm_after_rope=arch.qk_norm_after_rope, activation=arch.activation,
        swiglu_alpha=float(c.swiglu_alpha), swiglu_limit=float(c.swiglu_limit),
        residual_multiplier=float(c.residual_multiplier), embedding_multiplier=float(c.embedding_multiplier),
        logit_multiplier=float(c.logit_multiplier),
        final_softcap=None if c.final_softcap is None else float(c.final_softcap))


def _embedding(model: CausalLM):
    """The token table: its GGUF blocks where the loader kept them (the output head's matrix
    where the two are tied), else the float table, read in place."""
    if isinstance(model.embed_tokens, QuantEmbedding):
        return model.embed_tokens.matrix
    return _array(model.embed_tokens.weight)


def _layer(layer: DecoderLayer, kinds: list[str]) -> _native.NativeLayer:
    norms = {name: _array(getattr(layer, name).weight) for name in
             ("attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm") if hasattr(layer, name)}
    mlp = _moe(layer.moe) if layer.moe is not None else \
        _native.NativeMlp(gate_up=_linear(layer.gate_up_proj), down=_linear(layer.down_proj))
    mixer: _native.NativeAttention | _native.NativeShortConv
    if layer.conv is not None:   # LFM2's gated short convolution instead of attention
        mixer = _native.NativeShortConv(
            in_proj=_linear(layer.conv_in_proj), out_proj=_linear(layer.conv_out_proj),
            weight=_array(layer.conv.weight).reshape(-1),   # [hidden, kernel], row-major
            bias=None if layer.conv.bias is None else _array(layer.conv.bias))
    else:
        mixer = _native.NativeAttention(
            qkv=_linear(layer.qkv_proj), o=_linear(layer.o_proj), scale=float(layer.scores.scale),
            window=layer.scores.window,
            softcap=None if layer.scores.softcap is None else float(layer.scores.softcap),
            sinks=None if layer.sinks is None else _array(layer.sinks),
            rope=None if layer.rope is None else kinds.index(layer.rope),
            **{name: _array(getattr(layer, name).weight) for name in ("q_norm", "k_norm") if hasattr(layer, name)})
    return _native.NativeLayer(mixer=mixer, mlp=mlp, **norms)


def _moe(moe: MoE) -> _native.NativeMoe:
    m = moe.config
    held = hasattr(moe, "gate_up_q")

    def expert(e: int) -> _native.NativeMlp:
        gate_up, down = (moe.gate_up_q[e], moe.down_q[e]) if held else (moe.gate_up[e], moe.down[e])
        biases = (moe.gate_up_bias[e], moe.down_bias[e]) if m.expert_bias else (None, None)
        return _native.NativeMlp(gate_up=_linear(gate_up, bias=biases[0]), down=_linear(down, bias=biases[1]))

    shared = _native.NativeMlp(gate_up=_linear(moe.shared_gate_up), down=_linear(moe.shared_down)) \
        if m.shared_intermediate_size else None
    return _native.NativeMoe(
        router=_linear(moe.router), scoring=m.scoring, top_k=m.top_k, norm_topk_prob=m.norm_topk_prob,
        routed_scaling=float(m.routed_scaling), groups=m.num_groups, topk_groups=m.topk_groups,
        experts=[expert(e) for e in range(m.num_experts)], shared=shared,
        selection_bias=_array(moe.router_bias) if m.scoring == "sigmoid" else None)


def _linear(weights, bias: torch.Tensor | None = None, precise: bool = False) -> _native.NativeLinear:
    """A QuantLinear's native matrices, an nn.Linear's float weight, or a bare float
    weight tensor (an expert's), with its bias (``bias``, given, over the module's)."""
    parts: list[_native.QuantMatrix | np.ndarray]
    if isinstance(weights, QuantLinear):
        parts, bias = list(weights.matrices), weights.bias if bias is None else bias
    elif isinstance(weights, nn.Linear):
        parts, bias = [_array(weights.weight)], weights.bias if bias is None else bias
    elif isinstance(weights, torch.Tensor):
        parts = [_array(weights)]
    else:
        raise NotNative(f"a {type(weights).__name__} layer")
    return _native.NativeLinear(parts=parts, bias=None if bias is None else _array(bias), precise=precise)


def _precise(module: nn.Module) -> bool:
    return isinstance(module, QuantLinear) and module.precise


def _array(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().float().numpy())


def _cache(t: torch.Tensor) -> np.ndarray:
    return t.numpy()   # the same memory: the decoder writes the runner's cache in place
