"""Loading a .gguf file: config from metadata, dequantised weights, tokenizer, template."""
from __future__ import annotations

import functools
from dataclasses import replace
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from .config import ModelConfig
from .delta_net import delta_ungrouped
from .gguf_file import GGUFFile, TensorInfo
from .pack_cache import PackCache
from .quant_linear import FORMATS, QuantWeight
from .tokenizer_gguf import build_gguf_tokenizer
from .weights import WeightSink

_TOP = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
        "output.weight": "lm_head.weight",
        "token_embd_norm.weight": "norm.weight"}   # LFM2's final norm (its model.embedding_norm)
# llama.cpp's names → the names WeightSink takes (weights.LAYER_MODULES)
_BLOCK = {"attn_norm": "attn_norm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "post_attention_norm": "attn_post_norm", "ffn_norm": "mlp_norm", "post_ffw_norm": "mlp_post_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          # DeepSeek's latent attention (deepseek2), kv_b_proj written as per-head k_b and v_b
          "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_norm", "attn_q_b": "self_attn.q_b_proj",
          "attn_kv_a_mqa": "self_attn.kv_a_proj", "attn_kv_a_norm": "self_attn.kv_a_norm",
          "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj"}
# LFM2's short convolution: blk.N.shortconv.<part>.weight
_SHORTCONV = {"in_proj": "conv_in_proj", "out_proj": "conv_out_proj", "conv": "conv"}
# Granite 4.0-H's Mamba-2 layers, by llama.cpp's name and suffix (ssm_a and ssm_d have none)
_SSM = {"ssm_in.weight": "mamba_in_proj.weight", "ssm_out.weight": "mamba_out_proj.weight",
        "ssm_in.bias": "mamba_in_proj.bias", "ssm_out.bias": "mamba_out_proj.bias",
        "ssm_conv1d.weight": "mamba_conv.weight", "ssm_conv1d.bias": "mamba_conv.bias",
        "ssm_norm.weight": "mamba_norm.weight", "ssm_dt.bias": "mamba.dt_bias", "ssm_a": "mamba.A_log",
        "ssm_d": "mamba.D",
        # Qwen3.5's Gated DeltaNet besides (its other tensors by the names above: the row's gguf_roles)
        "attn_gate.weight": "delta_in_z.weight", "ssm_beta.weight": "delta_in_b.weight",
        "ssm_alpha.weight": "delta_in_a.weight",
        "ssm_ba.weight": "delta_in_ba.weight"}   # Qwen3-Next's b|a, grouped by key head


# a mixture-of-experts MLP's tensors, whole names by llama.cpp's name and suffix (weights.WeightSink._add_moe)
_MOE = {"ffn_gate_inp.weight": "moe.router.weight", "ffn_gate_inp.bias": "moe.router.bias",   # gpt-oss's bias
        "exp_probs_b.bias": "moe.router_bias",
        "ffn_gate_exps.weight": "moe.gate_exps", "ffn_up_exps.weight": "moe.up_exps",
        "ffn_down_exps.weight": "moe.down_exps",
        "ffn_gate_exps.bias": "moe.gate_exps_bias", "ffn_up_exps.bias": "moe.up_exps_bias",
        "ffn_down_exps.bias": "moe.down_bias",
        "ffn_gate_shexp.weight": "moe.shared.gate_proj.weight", "ffn_up_shexp.weight": "moe.shared.up_proj.weight",
        "ffn_down_shexp.weight": "moe.shared.down_proj.weight",
        "ffn_gate_inp_shexp.weight": "moe.shared_gate"}     # Qwen3.5-MoE's σ gate of the shared expert


def our_name(gguf_name: str) -> str | None:
    """The name WeightSink takes for a GGUF tensor (None: not a weight we hold)."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] != "blk":
        return None
    if ".".join(parts[2:]) in _MOE:
        return f"layers.{parts[1]}.{_MOE['.'.join(parts[2:])]}"
    if ".".join(parts[2:]) in _SSM:
        return f"layers.{parts[1]}.{_SSM['.'.join(parts[2:])]}"
    if parts[2] == "shortconv" and parts[3] in _SHORTCONV:
        return f"layers.{parts[1]}.{_SHORTCONV[parts[3]]}.{parts[4]}"
    if parts[2] == "attn_sinks":
        return f"layers.{parts[1]}.sinks"
    if parts[2] not in _BLOCK:
        return None
    return f"layers.{parts[1]}.{_BLOCK[parts[2]]}.{parts[3]}"


def _layer(name: str) -> int:
    """The layer a tensor belongs to (-1 for the embeddings, final norm and head)."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "layers" else -1


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head (2, d/2) → (d/2, 2) row interleave, back to the HF half-split layout.
    Rows move whole, so it applies to a quantized tensor's rows of blocks as well."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def latent_halves(name: str, w: torch.Tensor, c: ModelConfig) -> torch.Tensor:
    """DeepSeek's rotary parts (each query head's last rope_dim rows, and the shared key's last
    rows of kv_a_proj) rotate in pairs, in HF checkpoints and llama.cpp's GGUFs alike; ours in
    halves, as Ernie's (unpermute). Rows move whole: a quantized tensor's rows of blocks too."""
    m = c.latent
    if name.endswith("kv_a_proj.weight"):
        return torch.cat([w[:m.kv_lora_rank], unpermute(w[m.kv_lora_rank:], 1)])
    heads = w.view(c.num_heads, m.nope_dim + m.rope_dim, -1)
    rot = unpermute(heads[:, m.nope_dim:].reshape(c.num_heads * m.rope_dim, -1), c.num_heads)
    return torch.cat([heads[:, :m.nope_dim], rot.view(c.num_heads, m.rope_dim, -1)], dim=1).reshape(w.shape)



def load_gguf(path: str, dtype: torch.dtype, device: torch.device, quantized: bool = False):
    """With `quantized`, the linear layers' weights stay in their GGUF block
    formats (QuantLinear) where ggml has a CPU kernel for the format; all else
    is dequantized to `dtype`."""
    gguf = GGUFFile(path)
    md = gguf.metadata
    cache = PackCache.for_file(gguf) if quantized else None
    config = ModelConfig.from_gguf(md)
    sink = WeightSink(config, dtype, device)
    freq_factors = None
    # Q/K rows that rotate in pairs: llama.cpp's converter interleaved them, or the model was made so
    permuted = config.arch.gguf_permuted_qk or config.arch.interleaved_rope
    _from_tensors(config, md, {info.name: info for info in gguf.tensors}, gguf)
    halves = {}   # per layer, DeepSeek's k_b and v_b until both are in
    for info in tqdm(gguf.tensors, desc="loading weights", unit="tensor", leave=False):
        if info.name == "rope_freqs.weight":
            freq_factors = torch.from_numpy(np.array(gguf.read(info), dtype=np.float32))
            continue
        name = our_name(info.name)
        if name is None or _layer(name) >= config.num_layers:   # past the last: GLM's prediction layer
            continue
        for usual, role in config.arch.gguf_roles:
            name = name.replace(f".{usual}.", f".{role}.")
        if name.endswith("up_proj.weight") and info.shape[0] == 2 * config.intermediate_size:
            name = name.replace("up_proj", "gate_up_proj")   # Phi-3's gate and up, fused as in its checkpoint
        if name.endswith("delta_in_ba.weight"):   # Qwen3-Next's b|a per key head: b and a, each over all heads
            b_a = delta_ungrouped(torch.from_numpy(np.array(gguf.read(info), dtype=np.float32)), config.delta, "ba")
            for part, w in zip(("delta_in_b", "delta_in_a"), b_a.chunk(2)):
                sink.add(name.replace("delta_in_ba", part), w)
            continue
        if name.endswith(("k_b_proj.weight", "v_b_proj.weight")):
            _kv_b(sink, halves, name, torch.from_numpy(np.array(gguf.read(info), dtype=np.float32)))
            continue
        move = _row_move(name, config, permuted)
        if quantized and info.qtype in FORMATS and name.endswith(_LINEAR_WEIGHTS):
            w = QuantWeight(int(info.qtype), info.shape[-1], gguf.raw_shape(info),
                            functools.partial(gguf.raw, info), info.name, cache)
            sink.add(name, w.moved(*move) if move else w)
        else:
            w = _as_ours(name, torch.from_numpy(np.array(gguf.read(info), dtype=np.float32)))
            sink.add(name, move[1](w) if move else w)
    model = sink.build()
    if cache is not None:
        cache.save()
    model.init_rotary(device, dtype, freq_factors)
    return config, model, md


def _row_move(name: str, config: ModelConfig, permuted: bool) -> tuple[str, Callable] | None:
    """How the rows of tensor `name` move into our layout (named, for QuantWeight.key), if they do."""
    if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
        return f"unpermute({config.num_heads})", functools.partial(unpermute, n_heads=config.num_heads)
    if permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
        return f"unpermute({config.num_kv_heads})", functools.partial(unpermute, n_heads=config.num_kv_heads)
    if config.latent is not None and config.latent.interleaved and \
            name.endswith(("q_proj.weight", "q_b_proj.weight", "kv_a_proj.weight")):
        return "latent_halves", lambda w: latent_halves(name, w, config)
    return None


def _kv_b(sink: WeightSink, halves: dict, name: str, w: torch.Tensor) -> None:
    """llama.cpp's k_b [heads, kv_lora_rank, nope] (transposed) and v_b [heads, v, kv_lora_rank] back
    into the checkpoint's kv_b_proj [heads · (nope + v), kv_lora_rank], once both are read."""
    prefix = name.rsplit(".", 2)[0]
    parts = halves.setdefault(prefix, {})
    parts[name.rsplit(".", 2)[1]] = w
    if len(parts) == 2:
        k_b, v_b = parts.pop("k_b_proj"), parts.pop("v_b_proj")
        joined = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
        sink.add(f"{prefix}.kv_b_proj.weight", joined.reshape(-1, joined.shape[-1]))


def _as_ours(name: str, w: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Mamba-2 tensors as the HF ones: A = −exp(A_log) [heads, 1] back to A_log, D
    [heads, 1] and the norm [groups, inner / groups] flat (the Gated DeltaNet's A likewise); a
    shared expert's gate as its [1, hidden] linear."""
    if name.endswith("moe.shared_gate"):
        return w.reshape(1, -1)
    if name.endswith(("mamba.A_log", "linear_attn.A_log")):
        return torch.log(-w).flatten()
    if name.endswith(("mamba.D", "mamba_norm.weight")):
        return w.flatten()
    return w


def _from_tensors(config: ModelConfig, md: dict, tensors: dict[str, TensorInfo], gguf: GGUFFile) -> None:
    """What a GGUF says with tensors rather than metadata: which layers are
    mixture-of-experts (Qwen3-MoE's mlp_only_layers, GLM's dense first layers),
    Mamba-2's biases, and Phi-3's LongRoPE factors."""
    if config.mamba is not None:
        first = next(i for i in range(config.num_layers) if config.is_mamba(i))
        config.mamba = replace(config.mamba, conv_bias=f"blk.{first}.ssm_conv1d.bias" in tensors,
                               proj_bias=f"blk.{first}.ssm_in.bias" in tensors,
                               out_bias=f"blk.{first}.ssm_out.bias" in tensors,
                               # llama.cpp's Mamba-2 graph: the norm after the gate, where the file has one
                               norm="gated" if f"blk.{first}.ssm_norm.weight" in tensors else "none")
    if config.moe is not None:
        dense = tuple(f"blk.{i}.ffn_gate_inp.weight" not in tensors for i in range(config.num_layers))
        config.moe = replace(config.moe, dense_layers=dense)
    if "rope_factors_long.weight" in tensors:
        arch = md["general.architecture"]
        factors = {k: np.array(gguf.read(tensors[f"rope_factors_{k}.weight"]), dtype=np.float32).tolist()
                   for k in ("long", "short")}
        config.rope_scaling = {
            "rope_type": "longrope", "long_factor": factors["long"], "short_factor": factors["short"],
            "original_max_position_embeddings": md[f"{arch}.rope.scaling.original_context_length"],
            "max_position_embeddings": config.max_position_embeddings,
            "attention_factor": md.get(f"{arch}.rope.scaling.attn_factor")}


# the weights a QuantLinear can hold: every projection and the output head; the embeddings stay
# in their blocks too (a QuantEmbedding, the head's matrix where the two are tied)
_LINEAR_WEIGHTS = ("proj.weight", "lm_head.weight", "embed_tokens.weight",
                   "moe.gate_exps", "moe.up_exps", "moe.down_exps",
                   # Qwen3.5's DeltaNet input projection, in parts the WeightSink joins
                   "delta_in_qkv.weight", "delta_in_z.weight", "delta_in_b.weight", "delta_in_a.weight")


def gguf_tokenizer_info(md: dict) -> dict:
    """Tokenizer, template and special tokens named by the GGUF metadata."""
    tokens = md["tokenizer.ggml.tokens"]

    def text(key):
        i = md.get(key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    end_ids = {md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                               "tokenizer.ggml.eom_token_id") if md.get(k) is not None}
    return {
        "tokenizer": build_gguf_tokenizer(md),
        "chat_template": md.get("tokenizer.chat_template"),
        "bos_token": text("tokenizer.ggml.bos_token_id"),
        "eos_token": text("tokenizer.ggml.eos_token_id"),
        "end_token_ids": {int(i) for i in end_ids},
        "add_bos_token": bool(md.get("tokenizer.ggml.add_bos_token", False)),
    }
