"""A GGUF written from a saved transformers directory the way llama.cpp's converter
(convert_hf_to_gguf.py and its conversion/ package) writes it, for the tests' tiny models
(helpers.tiny_models): the same architecture name, metadata keys, tensor names and tensor
transformations, so that the engine's GGUF loader is tested against the layout real GGUF
files have. `write_gguf(hf_dir, path, qtype)` writes F32 or Q8_0.

One `Arch` row per HF model_type says what differs from the plain TextModel path:
- `name`: general.architecture (MistralForCausalLM is "llama"; Mistral3ForConditionalGeneration
  is "mistral3"; an all-attention GraniteMoeHybrid is "granite", or "granitemoe" with experts);
- `meta`: the set_gguf_parameters of the converter's class (helpers below, one per class);
- `permute_qk`: LlamaModel subclasses interleave each head's rotary halves in Q/K rows;
- `norm_shift`: Gemma's (1 + w) RMSNorm weights are written with the 1 added;
- `split_qkv`: ERNIE's fused qkv_proj / up_gate_proj are split (phi3 keeps attn_qkv and a
  double-height ffn_up, as llama.cpp's phi3 graph reads them);
- `skip_lm_head`: Gemma 2 never writes output.weight; HunYuan skips it when tied;
- `modify`: the converter class's own modify_tensors (LFM2: its Conv1d weight squeezed to 2-D;
  Granite 4.0-H: Mamba2Model's A = −exp(A_log), [heads, 1] A and D, the grouped norm;
  gpt-oss: transformers' [E, in, out]
  experts transposed and their interleaved gate/up columns split, biases likewise, sinks
  named `.weight`).
Common to all: wrapper prefixes are stripped and vision/projector tensors dropped, MoE
experts are stacked into 3-D `ffn_{gate,up,down}_exps` (from per-expert tensors or from
transformers 5's fused gate_up_proj/down_proj), GLM's e_score_correction_bias becomes
exp_probs_b.bias, Granite's shared_mlp.input_linear is split into gate and up, llama3 RoPE
gets its rope_freqs tensor and LongRoPE its rope_factors_{long,short}.

Tensor types as the converter's prepare_tensors: 1-D tensors, norms, biases, the MoE
router (ffn_gate_inp) and the convolutions (shortconv.conv, ssm_conv1d) stay F32; the rest take
`qtype`, and a row length Q8_0 cannot block (not a multiple of 32) falls back to F16 as
the converter does. "MXFP4_MOE" writes the
experts' matrices in MXFP4, as the converter repacks gpt-oss's Hub blocks (here quantized from
the float experts by gguf's MXFP4 quantizer: the same block layout and values) and the rest F32.

The tokenizer section is what the engine's reader needs: byte-level "gpt2" model with
pre "default" (the converter would stop at the tiny vocabulary's unknown pre-tokenizer hash),
token i = the tokenizer's string for id i, token types (added special tokens CONTROL), the
tokenizer.json merges (none for the tiny WordLevel vocabulary), bos/eos ids and chat template.

What such a GGUF does not say, because llama.cpp hard-codes it or its converter drops it:
smollm3's NoPE step (every 4th layer), gemma2's alternating and gemma3's 5-local-1-global
sliding pattern, Gemma 2's RoPE base (10000), and Mistral's sliding_window (MistralForCausalLM
goes through LlamaModel, which writes none).

Where this deliberately differs from the converter:
- rope_freqs for llama3 uses rope_parameters' original_max_position_embeddings; the converter
  reads a top-level key that transformers 5 configs no longer have and falls back to 8192;
- GraniteMoeHybrid layer_types "full_attention" (transformers 5's spelling) count as attention;
  the converter only recognises "attention";
- Qwen3-MoE layers named in mlp_only_layers are written as dense blk.N.ffn_{gate,up,down};
  llama.cpp's qwen3moe has no such tensors and its converter refuses them.
"""
from __future__ import annotations

import glob
import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import gguf
import numpy as np
import torch
from safetensors import safe_open

T = gguf.MODEL_TENSOR
_QTYPES = {"F32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
           "Q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
           "MXFP4_MOE": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.MOSTLY_MXFP4_MOE)}


# ---------------------------------------------------------------- hparams

class HParams:
    """The converter's view of config.json: AutoConfig(...).to_dict() with text_config lifted to
    the root, and RoPE parameters normalised as TextModel.__init__ does."""

    def __init__(self, hf_dir: str, ftype: gguf.LlamaFileType):
        import transformers
        try:
            c = transformers.AutoConfig.from_pretrained(hf_dir).to_dict()
        except Exception:
            with open(os.path.join(hf_dir, "config.json")) as f:
                c = json.load(f)
        self.model_type = c.get("model_type")
        if isinstance(c.get("text_config"), dict):
            c = {**c, **c["text_config"]}
        self.c, self.ftype, self.dir = c, ftype, hf_dir
        self.n_layers = self.find("n_layers", "num_hidden_layers", "n_layer", "num_layers")
        rp = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        theta = self.find("global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta",
                          "rotary_emb_base")
        local = self.find("local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta",
                          "rope_local_base_freq")
        if "full_attention" not in rp and "sliding_attention" not in rp:
            if local is not None:
                rp["sliding_attention"] = {"rope_theta": local}
            if "rope_theta" not in rp and theta is not None:
                rp["rope_theta"] = theta
            if "rope_type" not in rp and "type" in rp:
                rp["rope_type"] = rp["type"]
        self.rope = rp
        self.rope_full = rp.get("full_attention", rp)

    def find(self, *keys, default=None):
        return next((self.c[k] for k in keys if self.c.get(k) is not None), default)

    @property
    def head_dim(self) -> int:
        return self.c.get("head_dim") or self.c["hidden_size"] // self.c["num_attention_heads"]


def _base(w: gguf.GGUFWriter, h: HParams) -> None:
    """TextModel.set_gguf_parameters."""
    w.add_block_count(h.n_layers)
    for add, keys in ((w.add_context_length, ("max_position_embeddings", "n_ctx", "n_positions", "max_length",
                                               "max_sequence_length", "model_max_length")),
                      (w.add_embedding_length, ("hidden_size", "n_embd", "dim")),
                      (w.add_feed_forward_length, ("intermediate_size", "n_inner", "hidden_dim")),
                      (w.add_head_count, ("num_attention_heads", "n_head", "n_heads")),
                      (w.add_head_count_kv, ("num_key_value_heads", "n_kv_heads")),
                      (w.add_layer_norm_rms_eps, ("rms_norm_eps", "norm_eps")),
                      (w.add_layer_norm_eps, ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")),
                      (w.add_expert_count, ("num_local_experts", "num_experts")),
                      (w.add_expert_used_count, ("num_experts_per_tok", "num_experts_per_token", "top_k_experts")),
                      (w.add_expert_group_count, ("n_group",)),
                      (w.add_expert_group_used_count, ("topk_group",))):
        if (v := h.find(*keys)) is not None:
            add(v)
    rp = h.rope_full
    rope_type, factor = rp.get("rope_type"), rp.get("factor")
    if rope_type == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif rope_type == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        _add_present(rp, ((w.add_rope_scaling_yarn_ext_factor, "extrapolation_factor"),
                          (w.add_rope_scaling_yarn_attn_factor, "attention_factor"),
                          (w.add_rope_scaling_yarn_beta_fast, "beta_fast"),
                          (w.add_rope_scaling_yarn_beta_slow, "beta_slow")))
    elif rope_type in ("su", "longrope"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    if (theta := rp.get("rope_theta")) is not None:
        w.add_rope_freq_base(theta)
    if (local := h.rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local)
    score = h.find("score_function", "scoring_func", "score_func", "moe_router_activation",
                   "moe_router_activation_func")
    if score is not None:
        w.add_expert_gating_func({"sigmoid": gguf.ExpertGatingFuncType.SIGMOID,
                                  "softmax": gguf.ExpertGatingFuncType.SOFTMAX}[score])
    if (head_dim := h.c.get("head_dim")) is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(h.ftype)


def _llama(w, h):
    """LlamaModel (also Mistral, Mistral3's Ministral3Model, SmolLM3)."""
    _base(w, h)
    w.add_vocab_size(h.c["vocab_size"])
    w.add_rope_dimension_count(h.head_dim)


def _granite(w, h):
    """GraniteModel: no head_dim, the multipliers as scales."""
    h.c.pop("head_dim", None)
    _llama(w, h)
    for add, key in ((w.add_attention_scale, "attention_multiplier"), (w.add_embedding_scale, "embedding_multiplier"),
                     (w.add_residual_scale, "residual_multiplier"), (w.add_logit_scale, "logits_scaling")):
        if h.c.get(key):
            add(h.c[key])


def _attn_layers(h) -> list[int]:
    return [i for i, t in enumerate(h.c.get("layer_types") or []) if t in ("attention", "full_attention")]


def _granite_arch(h) -> str:
    if len(_attn_layers(h)) < h.n_layers:
        return "granitehybrid"
    return "granitemoe" if h.find("num_experts_per_tok", "num_experts_per_token") else "granite"


def _granite_moe(w, h):
    """GraniteMoeModel: GraniteModel's keys and the shared MLP's width."""
    _granite(w, h)
    if (shared := h.c.get("shared_intermediate_size")):
        w.add_expert_shared_feed_forward_length(shared)


def _granite_hybrid(w, h):
    """GraniteHybridModel (GraniteMoeModel's keys, the Mamba2 ones, per-layer KV heads)."""
    _granite_moe(w, h)
    attn = _attn_layers(h)
    w.add_ssm_conv_kernel(h.find("conv_kernel", "d_conv", "mamba_d_conv"))
    w.add_ssm_state_size(h.find("state_size", "d_state", "state_dim", "ssm_state_size", "mamba_d_state"))
    w.add_ssm_group_count(h.find("n_groups", "num_groups", "mamba_n_groups"))
    w.add_ssm_inner_size(h.find("expand", "num_heads", "mamba_expand") * h.c["hidden_size"])
    w.add_ssm_time_step_rank(h.find("n_heads", "mamba_n_heads"))
    w.add_head_count_kv([h.c["num_key_value_heads"] if i in attn else 0 for i in range(h.n_layers)])
    use_rope = len(attn) == h.n_layers
    w.add_rope_scaling_finetuned(use_rope)
    if not use_rope:
        w.add_context_length(2 ** 20)


def _lfm2(w, h):
    """LFM2Model: a KV head count per layer (0 for the convolution layers), the kernel size, and the
    MLP's width as Lfm2MLP adjusts it."""
    c = h.c
    c["num_key_value_heads"] = [c["num_key_value_heads"] if t == "full_attention" else 0 for t in c["layer_types"]]
    width = c.pop("intermediate_size")
    if c.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if c.get("block_ffn_dim_multiplier") is not None:
            step = c["block_multiple_of"]
            width = step * ((int(c["block_ffn_dim_multiplier"] * width) + step - 1) // step)
    _base(w, h)
    w.add_vocab_size(c["vocab_size"])
    w.add_shortconv_l_cache(c["conv_L_cache"])
    w.add_feed_forward_length(width)


def _lfm2_tensors(name: str, t: torch.Tensor, h) -> Iterator[tuple[str, torch.Tensor]]:
    """The Conv1d's [hidden, 1, kernel] as the 2-D tensor ggml's convolution takes."""
    yield name, t.squeeze(1) if "conv.conv" in name else t


def _deepseek2(w, h):
    """DeepseekV2Model (DeepSeek V3, Kimi K2): latent attention written as MQA with one KV head whose
    key is the cache entry (kv_lora_rank + rope) and whose value the latent, the per-head sizes under
    *_mla; the experts' keys; YaRN's log multiplier 0.1 · mscale_all_dim."""
    c = h.c
    c["num_key_value_heads"] = 1
    _base(w, h)
    lora, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
    w.add_leading_dense_block_count(c.get("first_k_dense_replace") or 0)
    w.add_vocab_size(c["vocab_size"])
    if c.get("q_lora_rank"):
        w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(lora)
    w.add_key_length(lora + rope)
    w.add_value_length(lora)
    w.add_key_length_mla(c["qk_nope_head_dim"] + rope)
    w.add_value_length_mla(c["v_head_dim"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_count(c["n_routed_experts"])
    w.add_expert_shared_count(c.get("n_shared_experts") or 0)
    if c.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(c["routed_scaling_factor"])
    if c.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope)
    if (m := h.rope_full.get("mscale_all_dim")) is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * m)


def _deepseek2_tensors(name: str, t: torch.Tensor, h) -> Iterator[tuple[str, torch.Tensor]]:
    """DeepseekV2Model.modify_tensors: kv_b_proj split per head into k_b (transposed: [heads,
    kv_lora_rank, nope]) and v_b ([heads, v, kv_lora_rank]), as MLA's absorbed form reads them
    (the converter splits before it sets the one KV head, so by the attention heads)."""
    if name.endswith("kv_b_proj.weight"):
        c = h.c
        kv = t.view(c["num_attention_heads"], c["qk_nope_head_dim"] + c["v_head_dim"], t.shape[-1])
        k_b, v_b = kv.split([c["qk_nope_head_dim"], c["v_head_dim"]], dim=1)
        yield name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2).contiguous()
        yield name.replace("kv_b_proj", "v_b_proj"), v_b.contiguous()
        return
    yield name, t


def _mamba2_tensors(name: str, t: torch.Tensor, h) -> Iterator[tuple[str, torch.Tensor]]:
    """Mamba2Model.modify_tensors (GraniteHybridModel's Mamba layers): the Conv1d squeezed to 2-D,
    A_log written as A = −exp(A_log) and D, both as [heads, 1], the gated norm as [groups, inner /
    groups], dt_bias under the dt_proj.bias name llama.cpp maps."""
    if ".mamba." in name:
        if name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif name.endswith("conv1d.weight"):
            t = t.squeeze(1)
        elif name.endswith(".A_log"):
            t = -torch.exp(t).reshape(-1, 1)
        elif name.endswith(".D"):
            t = t.reshape(-1, 1)
        elif name.endswith("mamba.norm.weight"):
            t = t.reshape(h.c["mamba_n_groups"], -1)
    yield name, t


def _qwen_moe(w, h):
    """Qwen2MoeModel / Qwen3MoeModel."""
    _base(w, h)
    if (v := h.c.get("moe_intermediate_size")) is not None:
        w.add_expert_feed_forward_length(v)
    if (v := h.c.get("shared_expert_intermediate_size")) is not None:
        w.add_expert_shared_feed_forward_length(v)


def _shape_keys(w, h) -> None:
    """The model's shape, for the converters that write their own key set (Phi-3, Gemma 2)."""
    c = h.c
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(h.n_layers)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c.get("num_key_value_heads") or c["num_attention_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])


def _phi3(w, h):
    """Phi3MiniModel: its own key set (no TextModel base)."""
    c, rp = h.c, h.rope_full
    rope_dims = int(rp.get("partial_rotary_factor", 1.0) * c["hidden_size"]) // c["num_attention_heads"]
    w.add_context_length(h.find("n_positions", "max_position_embeddings"))
    w.add_rope_scaling_orig_ctx_len(_orig_ctx(h))
    _shape_keys(w, h)
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_file_type(h.ftype)
    w.add_sliding_window(c.get("sliding_window") or 0)
    if rp.get("long_factor"):
        scale = h.find("n_positions", "max_position_embeddings") / _orig_ctx(h)
        kind = rp.get("rope_type", "").lower()
        attn = (math.sqrt(1 + math.log(scale) / math.log(_orig_ctx(h))) if kind in ("su", "longrope")
                else 0.1 * math.log(scale) + 1.0) if scale > 1.0 else 1.0
        w.add_rope_scaling_attn_factors(attn)


def _orig_ctx(h) -> int:
    return h.rope_full.get("original_max_position_embeddings", h.c.get("original_max_position_embeddings"))


def _olmo2(w, h):
    _base(w, h)
    if "sliding_window" in h.c:
        w.add_sliding_window(h.c["sliding_window"])
        types = h.c.get("layer_types")
        w.add_sliding_window_pattern([t == "sliding_attention" for t in types] if types
                                     else [(i + 1) % 4 != 0 for i in range(h.n_layers)])


def _exaone4(w, h):
    _base(w, h)
    w.add_vocab_size(h.c["vocab_size"])
    if h.c.get("sliding_window") is not None:
        w.add_sliding_window(h.c["sliding_window"])
        if "layer_types" in h.c:
            w.add_sliding_window_pattern([t == "sliding_attention" for t in h.c["layer_types"]])


def _cohere2(w, h):
    """Cohere2Model: the logit scale and window; llama.cpp hard-codes which layers slide and rotate."""
    _base(w, h)
    w.add_logit_scale(h.c["logit_scale"])
    w.add_sliding_window(h.c["sliding_window"])
    w.add_vocab_size(h.c["vocab_size"])
    w.add_rope_dimension_count(h.head_dim)
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)


def _hunyuan_dense(w, h):
    """HunYuanModel: a num_experts of 1 is not MoE (the base would write it)."""
    experts = h.c.pop("num_experts", None)
    _base(w, h)
    if experts is not None and experts > 1:
        w.add_expert_count(experts)


def _gemma2(w, h):
    """Gemma2Model: its own key set (no TextModel base, so no rope.freq_base)."""
    c = h.c
    w.add_context_length(c["max_position_embeddings"])
    _shape_keys(w, h)
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_file_type(h.ftype)
    w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
    w.add_final_logit_softcapping(c["final_logit_softcapping"])
    w.add_sliding_window(c["sliding_window"])


def _gemma3(w, h):
    c = h.c
    _base(w, h)
    w.add_context_length(c.get("max_position_embeddings", 131072))
    w.add_head_count(c.get("num_attention_heads", 8))
    w.add_layer_norm_rms_eps(c.get("rms_norm_eps", 1e-6))
    w.add_key_length(c.get("head_dim", 256))
    w.add_value_length(c.get("head_dim", 256))
    w.add_rope_freq_base(h.rope_full.get("rope_theta", 1_000_000.0))
    if c.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
    if c.get("sliding_window_pattern") != 1:
        w.add_sliding_window(c["sliding_window"])
    w.add_head_count_kv(c.get("num_key_value_heads", 4))


def _gpt_oss(w, h):
    """GptOssModel: the base keys (YaRN's among them), the window, the experts' width."""
    _base(w, h)
    w.add_sliding_window(h.c["sliding_window"])
    w.add_expert_feed_forward_length(h.c["intermediate_size"])
    w.add_expert_count(h.find("num_local_experts", "num_experts"))
    w.add_expert_used_count(h.find("num_experts_per_tok"))


def _gpt_oss_tensors(name: str, t: torch.Tensor, h) -> Iterator[tuple[str, torch.Tensor]]:
    """GptOssModel.filter_tensors / modify_tensors for unquantized experts (what transformers
    saves): gate/up alternate in the last dimension of gate_up_proj [E, H, 2I] and its bias."""
    if name.endswith("self_attn.sinks"):
        yield name + ".weight", t
    elif name.endswith("mlp.experts.gate_up_proj_bias"):
        stem = name.removesuffix("gate_up_proj_bias")
        yield stem + "gate_proj.bias", t[..., ::2].contiguous()
        yield stem + "up_proj.bias", t[..., 1::2].contiguous()
    elif name.endswith("mlp.experts.gate_up_proj"):
        stem, t = name.removesuffix("gate_up_proj"), t.transpose(-1, -2)
        yield stem + "gate_proj.weight", t[:, ::2, :].contiguous()
        yield stem + "up_proj.weight", t[:, 1::2, :].contiguous()
    elif name.endswith("mlp.experts.down_proj_bias"):
        yield name.replace("down_proj_bias", "down_proj.bias"), t
    elif name.endswith("mlp.experts.down_proj"):
        yield name + ".weight", t.transpose(-1, -2).contiguous()
    else:
        yield name, t


def _add_present(source: dict, adders) -> None:
    """Write each (writer method, config key) whose key the config has."""
    for add, key in adders:
        if source.get(key) is not None:
            add(source[key])


def _glm4_moe(w, h):
    c = h.c
    _base(w, h)
    partial = c.get("partial_rotary_factor", h.rope_full.get("partial_rotary_factor", 0.5))
    w.add_rope_dimension_count(int(h.head_dim * partial))
    _add_present(c, ((w.add_expert_count, "n_routed_experts"),
                     (w.add_expert_feed_forward_length, "moe_intermediate_size"),
                     (w.add_expert_shared_count, "n_shared_experts"),
                     (w.add_leading_dense_block_count, "first_k_dense_replace")))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if c.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(c["routed_scaling_factor"])
    if c.get("norm_topk_prob") is not None:
        w.add_expert_weights_norm(c["norm_topk_prob"])
    if c.get("num_nextn_predict_layers") is not None:
        w.add_nextn_predict_layers(c["num_nextn_predict_layers"])


def _qwen35(w, h, mrope: bool = True):
    """Qwen3_5TextModel / Qwen3_5MoeTextModel: Qwen2MoeModel's keys, Qwen3NextModel's Gated DeltaNet
    ones (k_dim as the state size, the key heads as groups, the value heads as the time-step rank),
    which layers are recurrent, the rotary width, and _Qwen35MRopeMixin's default sections."""
    c = h.c
    _qwen_moe(w, h)
    w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    w.add_ssm_state_size(c["linear_key_head_dim"])
    w.add_ssm_group_count(c["linear_num_key_heads"])
    w.add_ssm_time_step_rank(c["linear_num_value_heads"])
    w.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
    if (types := c.get("layer_types")) is not None:   # GGUFWriter.add_recurrent_layers (newer gguf)
        w.add_array(f"{w.arch}.attention.recurrent_layers", [t == "linear_attention" for t in types])
    w.add_full_attention_interval(c.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(h.head_dim * h.rope_full.get("partial_rotary_factor", 0.25)))
    if mrope and "mrope_section" not in h.rope_full:
        w.add_rope_dimension_sections([11, 11, 10, 0])


def _qwen3next(w, h):
    """Qwen3NextModel: _qwen35's keys without the MRoPE sections."""
    _qwen35(w, h, mrope=False)


def _qwen3next_tensors(name: str, t: torch.Tensor, h) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3NextModel.modify_tensors: in_proj_qkvz (per key head [q, k, v, z]) split into q|k|v over
    all heads (attn_qkv) and z (attn_gate), in_proj_ba kept as it is (ssm_ba), and _qwen35_tensors'
    A, dt_bias, Conv1d and norms (no value heads reordered)."""
    c = h.c
    if name.endswith("in_proj_qkvz.weight"):
        k_heads, k_dim = c["linear_num_key_heads"], c["linear_key_head_dim"]
        share = c["linear_num_value_heads"] // k_heads * c["linear_value_head_dim"]
        q, k, v, z = t.view(k_heads, 2 * k_dim + 2 * share, -1).split([k_dim, k_dim, share, share], dim=1)
        flat = [x.reshape(-1, t.shape[-1]) for x in (q, k, v, z)]
        yield f"blk.{name.split('.')[2]}.attn_qkv.weight", torch.cat(flat[:3])
        yield f"blk.{name.split('.')[2]}.attn_gate.weight", flat[3]
        return
    yield from _qwen35_tensors(name, t, h, reorder=False)


def _qwen35_tensors(name: str, t: torch.Tensor, h, reorder: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """_LinearAttentionVReorderBase.modify_tensors (the value heads from grouped by key head to
    tiled, for ggml's broadcast), then Qwen3NextModel's: A = −exp(A_log), dt_bias under the
    dt_proj.bias name, the Conv1d squeezed, 1 added to every norm but the DeltaNet's."""
    c = h.c
    k_heads, v_heads = c["linear_num_key_heads"], c["linear_num_value_heads"]
    k_dim, v_dim, share = c["linear_key_head_dim"], c["linear_value_head_dim"], v_heads // k_heads

    def tiled(x: torch.Tensor, dim: int, head: int) -> torch.Tensor:
        shape = list(x.shape)
        x = x.reshape(*shape[:dim], k_heads, share, head, *shape[dim + 1:])
        return x.transpose(dim, dim + 1).contiguous().reshape(shape)

    if reorder and "linear_attn." in name and k_heads != v_heads:
        if ".in_proj_qkv." in name:
            t = torch.cat([t[:2 * k_heads * k_dim], tiled(t[2 * k_heads * k_dim:], 0, v_dim)])
        elif ".in_proj_z." in name:
            t = tiled(t, 0, v_dim)
        elif ".in_proj_b." in name or ".in_proj_a." in name:
            t = tiled(t, 0, 1)
        elif name.endswith((".A_log", ".dt_bias")):
            t = tiled(t.unsqueeze(-1), 0, 1).squeeze(-1)
        elif ".conv1d" in name:
            t = t.squeeze()
            t = torch.cat([t[:2 * k_heads * k_dim], tiled(t[2 * k_heads * k_dim:], 0, v_dim)])
        elif ".out_proj." in name:
            t = tiled(t, 1, v_dim)
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    yield name, t


def _falcon_h1(w, h):
    """FalconH1Model (over Mamba2Model's keys): the SSM's sizes, the attention's, the MLP's width."""
    c = h.c
    inner = c.get("mamba_d_ssm") or c["mamba_expand"] * c["hidden_size"]
    head = c.get("mamba_d_head")
    head = inner // c["mamba_n_heads"] if head in (None, "auto") else head
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(h.n_layers)
    w.add_ssm_conv_kernel(c["mamba_d_conv"])
    w.add_ssm_inner_size(inner)
    w.add_ssm_state_size(c["mamba_d_state"])
    w.add_ssm_time_step_rank(inner // head)
    w.add_ssm_group_count(c["mamba_n_groups"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_file_type(h.ftype)
    w.add_vocab_size(c["vocab_size"])
    w.add_context_length(c.get("max_position_embeddings", 0))
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_freq_base(h.rope_full["rope_theta"])


def _falcon_h1_tensors(name: str, t: torch.Tensor, h) -> Iterator[tuple[str, torch.Tensor]]:
    """FalconH1Model.modify_tensors: Mamba2Model's (A, D, the Conv1d, dt_bias, the grouped norm),
    then each µP multiplier folded into the tensor it surrounds (weights and biases alike, as the
    converter does); the MLP's input norm under ffn_norm."""
    c = h.c
    if name.endswith("pre_ff_layernorm.weight"):
        yield f"blk.{name.split('.')[2]}.ffn_norm.weight", t
        return
    ((name, t),) = list(_mamba2_tensors(name, t, h))
    mlp, ssm = c.get("mlp_multipliers") or (1.0, 1.0), c.get("ssm_multipliers") or (1.0,) * 5
    if "down_proj" in name:
        t = t * mlp[1]
    elif "gate_proj" in name:
        t = t * mlp[0]
    elif "k_proj" in name:
        t = t * c["key_multiplier"] * c["attention_in_multiplier"]
    elif "q_proj" in name or "v_proj" in name:
        t = t * c["attention_in_multiplier"]
    elif "o_proj" in name:
        t = t * c["attention_out_multiplier"]
    elif "out_proj" in name:
        t = t * c["ssm_out_multiplier"]
    elif "in_proj" in name:
        t = t * c["ssm_in_multiplier"]
        inner, groups = c["mamba_d_ssm"], c["mamba_n_groups"] * c["mamba_d_state"]
        for (lo, hi), f in zip(((0, inner), (inner, 2 * inner), (2 * inner, 2 * inner + groups),
                                (2 * inner + groups, 2 * inner + 2 * groups), (2 * inner + 2 * groups, None)), ssm):
            t[lo:hi] *= f
    elif "lm_head" in name:
        t = t * c["lm_head_multiplier"]
    elif "embed_tokens" in name:
        t = t * c["embedding_multiplier"]
    yield name, t


# ---------------------------------------------------------------- generated tensors

def _llama3_rope_freqs(h) -> Iterator[tuple[str, torch.Tensor]]:
    rp = h.rope_full
    if rp.get("rope_type", "").lower() != "llama3":
        return
    dim, base = h.head_dim, rp.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rp.get("factor", 8.0), rp.get("low_freq_factor", 1.0), rp.get("high_freq_factor", 4.0)
    old = rp.get("original_max_position_embeddings", h.c.get("original_max_position_embeddings", 8192))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    yield gguf.TENSOR_NAMES[T.ROPE_FREQS] + ".weight", torch.tensor(out, dtype=torch.float32)


def _longrope_factors(h) -> Iterator[tuple[str, torch.Tensor]]:
    rp = h.rope_full
    if rp.get("long_factor"):
        for kind, key in ((T.ROPE_FACTORS_LONG, "long_factor"), (T.ROPE_FACTORS_SHORT, "short_factor")):
            yield gguf.TENSOR_NAMES[kind] + ".weight", torch.tensor(rp[key], dtype=torch.float32)


# ---------------------------------------------------------------- the table

@dataclass(frozen=True)
class Arch:
    name: str | Callable[[HParams], str]
    meta: Callable[[gguf.GGUFWriter, HParams], None] = _base
    permute_qk: bool = False
    norm_shift: float = 0.0
    split_qkv: bool = False
    skip_lm_head: str | None = None          # "always" | "tied"
    extra: Callable[[HParams], Iterable[tuple[str, torch.Tensor]]] = _llama3_rope_freqs
    modify: Callable[[str, torch.Tensor, HParams], Iterable[tuple[str, torch.Tensor]]] | None = None


ARCHS: dict[str, Arch] = {  # keyed by config.json's model_type
    "llama": Arch("llama", _llama, permute_qk=True),
    "mistral": Arch("llama", _llama, permute_qk=True),
    "mistral3": Arch("mistral3", _llama, permute_qk=True),
    "qwen2": Arch("qwen2"),
    "qwen3": Arch("qwen3"),
    "phi3": Arch("phi3", _phi3, extra=_longrope_factors),
    "granite": Arch("granite", _granite, permute_qk=True),
    "granitemoeshared": Arch("granitemoe", _granite_moe, permute_qk=True),
    "granitemoehybrid": Arch(_granite_arch, _granite_hybrid, permute_qk=True, modify=_mamba2_tensors),
    "smollm3": Arch("smollm3", _llama, permute_qk=True),
    "olmo2": Arch("olmo2", _olmo2),
    "exaone4": Arch("exaone4", _exaone4),
    "ernie4_5": Arch("ernie4_5", split_qkv=True),
    "hunyuan_v1_dense": Arch("hunyuan-dense", _hunyuan_dense, skip_lm_head="tied"),
    "cohere2": Arch("cohere2", _cohere2),
    "gemma2": Arch("gemma2", _gemma2, norm_shift=1.0, skip_lm_head="always"),
    "gemma3_text": Arch("gemma3", _gemma3, norm_shift=1.0),
    "qwen3_moe": Arch("qwen3moe", _qwen_moe),
    "glm4_moe": Arch("glm4moe", _glm4_moe),
    "gpt_oss": Arch("gpt-oss", _gpt_oss, modify=_gpt_oss_tensors),
    "lfm2": Arch("lfm2", _lfm2, modify=_lfm2_tensors),
    "deepseek_v3": Arch("deepseek2", _deepseek2, modify=_deepseek2_tensors),
    "qwen3_5_text": Arch("qwen35", _qwen35, modify=_qwen35_tensors),
    "qwen3_5_moe_text": Arch("qwen35moe", _qwen35, modify=_qwen35_tensors),
    "qwen3_next": Arch("qwen3next", _qwen3next, modify=_qwen3next_tensors),
    "falcon_h1": Arch("falcon-h1", _falcon_h1, modify=_falcon_h1_tensors),
}

_MULTIMODAL = ("vision_tower.", "vision_model.", "multi_modal_projector.", "model.vision_tower.",
               "model.multi_modal_projector.", "audio_tower.")
_WRAPPERS = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
             ("model.language_model.", "model."), ("language_model.", ""))


# ---------------------------------------------------------------- tensors

def _read(hf_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for part in sorted(glob.glob(os.path.join(hf_dir, "model*.safetensors"))):
        with safe_open(part, "pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).float()


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """LlamaModel.permute: per head, rows (2, d/2) -> (d/2, 2)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _split(name: str, t: torch.Tensor, arch: Arch, h: HParams) -> Iterator[tuple[str, torch.Tensor]]:
    """Fused tensors into the parts llama.cpp names (a tensor not fused passes through)."""
    c = h.c
    if arch.split_qkv and name.endswith("qkv_proj.weight"):
        q, k = c["num_attention_heads"] * h.head_dim, c["num_key_value_heads"] * h.head_dim
        for part, x in zip(("q_proj", "k_proj", "v_proj"), t.split([q, k, k], dim=0)):
            yield name.replace("qkv_proj", part), x
    elif arch.split_qkv and name.endswith("up_gate_proj.weight"):
        gate, up = t.split(t.shape[0] // 2, dim=0)
        yield name.replace("up_gate_proj", "gate_proj"), gate
        yield name.replace("up_gate_proj", "up_proj"), up
    elif name.endswith("shared_mlp.input_linear.weight"):  # GraniteMoeModel: shared expert, or the dense FFN
        gate, up = t.split(t.shape[0] // 2, dim=0)
        shexp = "_shexp" if c.get("num_local_experts") else ""
        yield f"blk.{name.split('.')[2]}.ffn_gate{shexp}.weight", gate
        yield f"blk.{name.split('.')[2]}.ffn_up{shexp}.weight", up
    elif name.endswith("shared_mlp.output_linear.weight"):
        shexp = "_shexp" if c.get("num_local_experts") else ""
        yield f"blk.{name.split('.')[2]}.ffn_down{shexp}.weight", t
    elif name.endswith(("block_sparse_moe.input_linear.weight", "mlp.experts.gate_up_proj",
                        "mlp.experts.gate_up_proj.weight")):
        gate, up = t.split(t.shape[-2] // 2, dim=-2)  # (experts, 2 * ff, hidden)
        stem = f"model.layers.{name.split('.')[2]}.mlp.experts"
        yield f"{stem}.gate_proj.weight", gate
        yield f"{stem}.up_proj.weight", up
    elif name.endswith("mlp.experts.down_proj"):
        yield name + ".weight", t
    elif name.endswith("e_score_correction_bias"):
        yield name.replace("e_score_correction_bias", "e_score_correction.bias"), t
    else:
        yield name, t


def _hf_tensors(hf_dir: str, arch: Arch, h: HParams) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with the converter's modify_tensors applied, HF-named;
    per-expert tensors come out stacked (experts, out, in) under mlp.experts.<proj>.weight."""
    tied = h.c.get("tie_word_embeddings", False)
    n_head, n_kv = h.c["num_attention_heads"], h.c.get("num_key_value_heads") or h.c["num_attention_heads"]
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    n_experts = h.find("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
    for name, t in _read(hf_dir):
        if name.startswith(_MULTIMODAL) or name.endswith(("rotary_emb.inv_freq", ".attention.masked_bias")):
            continue
        for old, new in _WRAPPERS:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        if name == "lm_head.weight" and (arch.skip_lm_head == "always" or (arch.skip_lm_head == "tied" and tied)):
            continue
        if arch.permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = _permute(t, n_head)
        elif arch.permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = _permute(t, n_kv)
        if arch.norm_shift and name.endswith("norm.weight"):
            t = t + arch.norm_shift
        modified = arch.modify(name, t, h) if arch.modify else [(name, t)]
        for name, t in (part for n, x in modified for part in _split(n, x, arch, h)):
            parts = name.split(".")
            if "experts" in parts and parts[parts.index("experts") + 1].isdecimal():
                i = parts.index("experts")
                layer, proj = int(parts[2]), parts[i + 2]
                got = experts.setdefault((layer, proj), {})
                got[int(parts[i + 1])] = t
                if len(got) == n_experts:
                    stem = ".".join(parts[:i + 1])
                    yield f"{stem}.{proj}.weight", torch.stack([got.pop(e) for e in range(n_experts)])
                continue
            yield name, t
    left = [k for k, v in experts.items() if v]
    if left:
        raise ValueError(f"incomplete experts: {left}")


def _gguf_name(name: str, maps: list[gguf.TensorNameMap]) -> str:
    if name.startswith("blk."):  # named by _split already
        return name
    for m in maps:
        if (new := m.get_name(name, try_suffixes=(".weight", ".bias"))) is not None:
            return new
    raise ValueError(f"cannot map tensor {name!r}")


def _to_file_type(new_name: str, data: np.ndarray, qtype: gguf.GGMLQuantizationType,
                  experts: gguf.GGMLQuantizationType | None = None):
    """prepare_tensors' type rule: returns (bytes-or-array, type). `experts`: the type of the
    MoE experts' matrices (*_exps.weight) where it differs (gpt-oss's MXFP4)."""
    if experts is not None and new_name.endswith("_exps.weight"):
        return gguf.quants.quantize(data, experts), experts
    # the MoE router (and Qwen3.5-MoE's shared expert's gate), and LFM2's and Mamba's convolutions
    # (ggml's takes F32)
    kept = any(k in new_name for k in (".ffn_gate_inp.", ".ffn_gate_inp_shexp.", ".shortconv.conv.", ".ssm_conv1d."))
    if data.ndim <= 1 or new_name.endswith("_norm.weight") or not new_name.endswith(".weight") or kept:
        qtype = gguf.GGMLQuantizationType.F32
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError:
        return gguf.quants.quantize(data, gguf.GGMLQuantizationType.F16), gguf.GGMLQuantizationType.F16


# ---------------------------------------------------------------- tokenizer

def _tokenizer(w: gguf.GGUFWriter, h: HParams) -> None:
    d = h.dir
    with open(os.path.join(d, "tokenizer.json")) as f:
        tj = json.load(f)
    tcfg = {}
    if os.path.exists(os.path.join(d, "tokenizer_config.json")):
        with open(os.path.join(d, "tokenizer_config.json")) as f:
            tcfg = json.load(f)
    vocab = dict(tj["model"].get("vocab") or {})
    added = {a["content"]: a for a in tj.get("added_tokens", [])}
    vocab.update({c: a["id"] for c, a in added.items()})
    reverse = {i: s for s, i in vocab.items()}
    tokens, types = [], []
    for i in range(h.c.get("vocab_size", len(reverse))):
        tok = reverse.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif tok in added:
            special = added[tok].get("special") or (tok.startswith("<|") and tok.endswith("|>"))
            tokens.append(tok)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(tok)
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges") or []]
    w.add_token_merges(merges)

    def token_id(typ):
        tok = tcfg.get(f"{typ}_token")
        tok = tok.get("content") if isinstance(tok, dict) else tok
        if tok in vocab:
            return vocab[tok]
        v = h.c.get(f"{typ}_token_id")
        return v if isinstance(v, int) and 0 <= v < len(tokens) else None

    for typ, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unk", w.add_unk_token_id),
                     ("pad", w.add_pad_token_id)):
        if (i := token_id(typ)) is not None:
            add(i)
    for key, add in (("add_bos_token", w.add_add_bos_token), ("add_eos_token", w.add_add_eos_token)):
        if isinstance(tcfg.get(key), bool):
            add(tcfg[key])
    if tcfg.get("chat_template"):
        w.add_chat_template(tcfg["chat_template"])
    if h.model_type == "hunyuan_v1_dense":  # HunYuanModel._fix_special_tokens
        if h.c.get("eod_token_id") is not None:
            w.add_eos_token_id(h.c["eod_token_id"])
        gen = os.path.join(d, "generation_config.json")
        if os.path.exists(gen):
            with open(gen) as f:
                eos = json.load(f).get("eos_token_id")
            if isinstance(eos, list) and len(eos) >= 2:
                w.add_eot_token_id(eos[0])


# ---------------------------------------------------------------- the file

def write_gguf(hf_dir, path, qtype: str = "F32") -> str:
    """Write `path` from the transformers directory `hf_dir` as llama.cpp's converter would
    for its architecture, weights in `qtype` ("F32" or "Q8_0"; "MXFP4_MOE": the experts in
    MXFP4, the rest F32); returns `path`."""
    hf_dir, path = str(hf_dir), str(path)
    ggml_type, ftype = _QTYPES[qtype]
    h = HParams(hf_dir, ftype)
    if h.model_type not in ARCHS:
        raise ValueError(f"no GGUF layout for model_type {h.model_type!r}")
    arch = ARCHS[h.model_type]
    name = arch.name(h) if callable(arch.name) else arch.name
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == name)
    # llama's names as the fallback, for the dense layers qwen3moe's own table lacks
    maps = [gguf.get_tensor_name_map(a, h.n_layers) for a in (model_arch, gguf.MODEL_ARCH.LLAMA)]

    logging.getLogger("gguf.gguf_writer").setLevel(logging.ERROR)  # the converter's overrides warn
    w = gguf.GGUFWriter(path, name)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(os.path.basename(os.path.normpath(hf_dir)))
    arch.meta(w, h)
    _tokenizer(w, h)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tensors = list(arch.extra(h)) + [(_gguf_name(n, maps), t) for n, t in _hf_tensors(hf_dir, arch, h)]
    for new_name, t in tensors:
        data, typ = _to_file_type(new_name, t.numpy(), ggml_type,
                                  gguf.GGMLQuantizationType.MXFP4 if qtype == "MXFP4_MOE" else None)
        w.add_tensor(new_name, data, raw_dtype=typ)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
