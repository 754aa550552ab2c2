"""Tiny random transformers models, one per architecture the engine loads, saved as a
safetensors directory the way a Hub checkpoint looks (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json).

`ARCHITECTURES[name]()` is the config; `build(name, directory)` saves the randomised model
there and returns it (eval mode, float32) as the reference. `helpers.gguf_writer.write_gguf`
turns such a directory into the GGUF llama.cpp's converter would write for it.

Every model: hidden 64, heads 4 of dim 16, vocabulary `VOCAB` (a WordLevel tokenizer of "w0".."w92",
"<unk>", "<s>", "<|end|>"), 512 positions. Across the set the heads are tied and untied and the
GQA ratios are 1, 2 and 4.

What transformers 5.23's `save_pretrained` writes (it reverses its load-time renames, so the
files carry the Hub checkpoints' names, and the loader must read exactly these):
- MoE experts (qwen3_moe, glm4_moe): one tensor per expert and projection,
  `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`, as Qwen3-MoE and GLM-4.5 are
  published, although the live module holds fused 3-D `experts.gate_up_proj` / `experts.down_proj`;
  router `mlp.gate.weight`, GLM's `mlp.gate.e_score_correction_bias` and `mlp.shared_experts.*`.
- mistral3: the wrapper's legacy prefixes, `language_model.model.layers.N...`,
  `language_model.model.{embed_tokens,norm}`, `language_model.lm_head.weight`, beside
  `vision_tower.*` and `multi_modal_projector.*` (the live module says `model.language_model.*`).
- phi3: fused `self_attn.qkv_proj.weight` (q, k, v rows) and `mlp.gate_up_proj.weight` (gate, up rows).
- granitemoehybrid (no experts): `shared_mlp.input_linear.weight` (gate, up rows) and
  `shared_mlp.output_linear.weight`; config.json says `layer_types: ["full_attention", ...]`
  where the published Granite 4 configs say "attention" (`hub_layout=True` writes those).
- gpt_oss: the experts stacked as the live module holds them, `mlp.experts.gate_up_proj`
  [E, H, 2I] (gate and up in alternate columns), `gate_up_proj_bias` [E, 2I], `down_proj`
  [E, I, H], `down_proj_bias` [E, H]; router `mlp.router.{weight,bias}`; `self_attn.sinks` [heads].
  Not the Hub's MXFP4 `*_blocks`/`*_scales` (tests/model/test_architectures.py builds those).
- cohere2: one `input_layernorm` per layer (a LayerNorm without bias) before attention and the MLP.
- lfm2: `conv.in_proj`, `conv.conv` (a Conv1d's [hidden, 1, kernel]) and `conv.out_proj` in its
  convolution layers, `self_attn.{q,k,v,out}_proj` and `q_layernorm`/`k_layernorm` in its attention
  layers, `operator_norm`, `ffn_norm`, `feed_forward.w1/w3/w2`, the final `embedding_norm`.
- ernie4_5: separate q/k/v and gate/up (transformers' own names; the original Baidu
  checkpoints' fused `qkv_proj` / `up_gate_proj` are not what HF repos publish).
"""
from __future__ import annotations

import copy
import json
import os
from typing import Callable

import torch
import transformers

VOCAB = 96

TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            eos_token_id=5)


def tiny_tokenizer(directory: str, eos: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(VOCAB - 3)}
    vocab.update({"<unk>": VOCAB - 3, "<s>": VOCAB - 2, eos: VOCAB - 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", eos])
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": eos, "bos_token": "<s>", "chat_template": "{{ messages[0]['content'] }}"}, f)


def randomise(model: torch.nn.Module) -> None:
    """Larger weights than HF's init (decisive argmaxes) and non-trivial norms and biases
    (MoE routers' score-correction biases, which are buffers, included)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("correction_bias"):
                b.normal_(0, 0.5)


def save_tiny(directory, config, cls, eos_ids) -> torch.nn.Module:
    """`cls(config)` (a model class or factory) randomised and saved with its tokenizer files."""
    torch.manual_seed(0)
    model = cls(config).eval()
    randomise(model)
    model.save_pretrained(directory)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos_ids, "bos_token_id": VOCAB - 2}, f)
    tiny_tokenizer(str(directory), "<|end|>")
    return model


def _tiny(**over) -> dict:
    """TINY with overrides, and no pad id (some configs default to 32000, past VOCAB);
    head_dim=None drops it, for configs that derive it from hidden_size / heads."""
    config = {**TINY, "pad_token_id": None, **over}
    if config["head_dim"] is None:
        del config["head_dim"]
    return config


def _mistral3() -> transformers.PretrainedConfig:
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, head_dim=16, image_size=32, patch_size=16)
    text = transformers.MistralConfig(**_tiny(num_key_value_heads=4, sliding_window=None, tie_word_embeddings=False))
    return transformers.Mistral3Config(vision_config=vision, text_config=text, tie_word_embeddings=False)


#: Qwen3.5's layers (the qwen3_5 row's), and the experts of Qwen3.5-MoE's and Qwen3-Next's rows
def _qwen3_5(**over) -> dict:
    """A fresh copy (configs may change the nested rope_parameters they are given)."""
    return {**copy.deepcopy(_QWEN3_5), **over}


_QWEN3_5 = dict(num_hidden_layers=4,
                layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_conv_kernel_dim=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.25})
_QWEN3_5_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=64)   # (a Q8_0 row)


# name -> config; the model is AutoModelForCausalLM's for it (mistral3: the conditional-generation
# wrapper). KV heads 4/2/1 (GQA 1, 2, 4) and tied/untied heads vary across the rows.
ARCHITECTURES: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    # a short original context so llama3 scaling changes frequencies the test positions reach
    "llama": lambda: transformers.LlamaConfig(**_tiny(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen2": lambda: transformers.Qwen2Config(**_tiny(tie_word_embeddings=True)),
    "qwen3": lambda: transformers.Qwen3Config(**_tiny(tie_word_embeddings=False)),
    "mistral": lambda: transformers.MistralConfig(**_tiny(num_key_value_heads=1, sliding_window=None)),
    "mistral_swa": lambda: transformers.MistralConfig(**_tiny(num_key_value_heads=1, sliding_window=8)),
    "mistral3": _mistral3,
    # partial rotary (12 of 16 dims) and LongRoPE whose original context (32) the tests cross
    "phi3": lambda: transformers.Phi3Config(**_tiny(head_dim=None, tie_word_embeddings=False,
        original_max_position_embeddings=32, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 32,
            "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.5], "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0]})),
    "granite": lambda: transformers.GraniteConfig(**_tiny(head_dim=None, num_key_value_heads=1,
        tie_word_embeddings=True, embedding_multiplier=2.0, attention_multiplier=0.1, residual_multiplier=0.5,
        logits_scaling=2.0)),
    # a Granite 4 "micro"-style dense model: every layer attention, no experts, RoPE
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(**_tiny(head_dim=None, tie_word_embeddings=True,
        layer_types=["attention"] * 2, num_local_experts=0, num_experts_per_tok=0, shared_intermediate_size=128,
        position_embedding_type="rope", mamba_n_heads=8, embedding_multiplier=2.0, attention_multiplier=0.1,
        residual_multiplier=0.5, logits_scaling=2.0)),
    # Granite 4.0-H: Mamba-2 layers (8 heads of 16 in 2 groups, a 16-wide state, 4 taps) around one
    # attention layer, no rotation anywhere (its "nope"), a dense shared MLP
    "granitemoehybrid_mamba": lambda: transformers.GraniteMoeHybridConfig(**_tiny(head_dim=None,
        tie_word_embeddings=True, layer_types=["linear_attention", "linear_attention", "full_attention",
                                               "linear_attention"], num_hidden_layers=4,
        # the shared MLP narrower than intermediate_size (the experts' width), as in real 4.0-H configs
        num_local_experts=0, num_experts_per_tok=0, shared_intermediate_size=96, position_embedding_type="nope",
        mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
        embedding_multiplier=2.0, attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=2.0)),
    # Granite 4.0-H Tiny/Small: the same Mamba-2 layers with experts in every layer (8, top 2, a softmax
    # over the chosen logits) beside the shared MLP, wider than the experts' intermediate_size
    "granitemoehybrid_moe": lambda: transformers.GraniteMoeHybridConfig(**_tiny(head_dim=None,
        tie_word_embeddings=True, layer_types=["linear_attention", "full_attention", "linear_attention",
                                               "linear_attention"], num_hidden_layers=4,
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, shared_intermediate_size=96,
        position_embedding_type="nope", mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, embedding_multiplier=2.0, attention_multiplier=0.1, residual_multiplier=0.5,
        logits_scaling=2.0)),
    # Granite 3's mixture of experts, all attention, with rotation: the same experts and shared MLP
    "granitemoeshared": lambda: transformers.GraniteMoeSharedConfig(**_tiny(head_dim=None, tie_word_embeddings=True,
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, shared_intermediate_size=96,
        embedding_multiplier=2.0, attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=2.0)),
    # Qwen3.5: Gated DeltaNet layers (2 key heads of 16 shared by 4 value heads of 16, 4 taps) around a
    # gated attention layer with a quarter of each head rotating; (1 + w) norms
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(**_tiny(tie_word_embeddings=True, **_qwen3_5())),
    # Qwen3.5-MoE: the same layers with experts in every one (8, top 2, renormalised) and a shared expert
    # gated by σ of a linear, wider than the experts
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(**_tiny(tie_word_embeddings=False,
                                                                     **_qwen3_5(**_QWEN3_5_EXPERTS))),
    # Qwen3-Next: Qwen3.5-MoE's layers with the DeltaNet's q|k|v|z and b|a projections grouped per key head
    # (value heads 8 of 8 over key heads 2: four per group), a dense MLP in its mlp_only_layers
    "qwen3_next": lambda: transformers.Qwen3NextConfig(**_tiny(tie_word_embeddings=True, **_qwen3_5(
        **_QWEN3_5_EXPERTS, linear_num_value_heads=8, linear_value_head_dim=8, mlp_only_layers=[1],
        norm_topk_prob=True))),
    # Nemotron-H: blocks of one sublayer each, Mamba-2 (8 heads of 16 in 2 groups), relu² MLPs without a
    # gate, and attention without rotation, in its own order (transformers 5's layers_block_type; the Hub's
    # hybrid_override_pattern "M-*M-" is the same)
    "nemotron_h": lambda: transformers.NemotronHConfig(**_tiny(num_hidden_layers=None, tie_word_embeddings=False,
        layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"],
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, intermediate_size=96)),
    # Nemotron 3 Nano's blocks: Mamba-2, attention and experts ("E": relu² experts without a gate,
    # DeepSeek V3's grouped σ router with its selection bias, one shared expert)
    "nemotron_h_moe": lambda: transformers.NemotronHConfig(**_tiny(num_hidden_layers=None,
        tie_word_embeddings=False, layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention",
                                                      "moe"],
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=64, n_group=2,
        topk_group=1, routed_scaling_factor=2.5)),
    # Falcon-H1: attention and Mamba-2 side by side in every layer, with µP multipliers everywhere
    # (each different from 1, so a multiplier folded into the wrong weight shows), no mixer norm
    "falcon_h1": lambda: transformers.FalconH1Config(**_tiny(tie_word_embeddings=False, num_hidden_layers=3,
        mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_rms_norm=False, embedding_multiplier=1.5, lm_head_multiplier=0.7, key_multiplier=0.8,
        attention_in_multiplier=1.2, attention_out_multiplier=0.9, ssm_in_multiplier=1.1, ssm_out_multiplier=0.6,
        ssm_multipliers=[0.5, 1.3, 0.7, 1.4, 0.9], mlp_multipliers=[1.25, 0.75])),
    # ... and with its mixer's norm after the gate's product, biases on the projections
    "falcon_h1_norm": lambda: transformers.FalconH1Config(**_tiny(tie_word_embeddings=True, num_hidden_layers=2,
        mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=3,
        mamba_rms_norm=True, mamba_norm_before_gate=True, projectors_bias=True, mamba_proj_bias=True,
        attention_bias=True, key_multiplier=1.3, ssm_multipliers=[1.2, 0.8, 1.1, 0.9, 1.5])),
    # NoPE on every 4th layer (llama.cpp hard-codes that step for smollm3)
    "smollm3": lambda: transformers.SmolLM3Config(**_tiny(num_hidden_layers=4, num_key_value_heads=1,
        tie_word_embeddings=True, no_rope_layers=[1, 1, 1, 0], bos_token_id=None)),
    "olmo2": lambda: transformers.Olmo2Config(**_tiny(head_dim=None, num_key_value_heads=4,
        tie_word_embeddings=False)),
    "exaone4": lambda: transformers.Exaone4Config(**_tiny(head_dim=None, num_hidden_layers=4, tie_word_embeddings=True,
        sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"])),
    "ernie4_5": lambda: transformers.Ernie4_5Config(**_tiny(tie_word_embeddings=True, use_bias=False)),
    "hunyuan_dense": lambda: transformers.HunYuanDenseV1Config(**_tiny(num_key_value_heads=1, tie_word_embeddings=True,
        eod_token_id=VOCAB - 1)),
    # llama.cpp hard-codes the sliding pattern: gemma2 alternates (layer 0 sliding), gemma3 has
    # every 6th layer global, so six layers; query_pre_attn_scalar = head_dim as llama.cpp assumes
    "gemma2": lambda: transformers.Gemma2Config(**_tiny(sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=20.0,
        final_logit_softcapping=15.0)),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**_tiny(num_hidden_layers=6, num_key_value_heads=1,
        sliding_window=8, query_pre_attn_scalar=16, layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**_tiny(tie_word_embeddings=False, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[0], norm_topk_prob=True)),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(**_tiny(head_dim=None, tie_word_embeddings=False,
        attention_bias=True, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=64,
        num_mtp_layers=0, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, use_qk_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # a parallel attention+MLP block after one LayerNorm, rotation (in pairs) on the sliding layers
    # only, three sliding then one full as llama.cpp hard-codes it, a logit scale
    "cohere2": lambda: transformers.Cohere2Config(**_tiny(head_dim=None, num_hidden_layers=4, tie_word_embeddings=True,
        sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"], logit_scale=0.25)),
    # multi-head latent attention (queries through a rank-32 bottleneck, a 32-wide latent and an 8-wide
    # rotary key per token, pairs interleaved; 32-wide nope parts, so llama.cpp's per-head k_b rows block
    # in Q8_0), YaRN with DeepSeek's mscale pair, grouped sigmoid experts (the Hub config's scoring_func)
    # with a shared one after a dense first layer
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**_tiny(head_dim=None, num_key_value_heads=4,
        tie_word_embeddings=False, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5, scoring_func="sigmoid",
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 128})),
    # GLM-4.7-Flash: the same attention with one query projection, its MLP kinds by mlp_layer_types
    "glm4_moe_lite": lambda: transformers.Glm4MoeLiteConfig(**_tiny(head_dim=None, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        mlp_layer_types=["dense", "sparse"])),
    # gated short convolutions (kernel 3) around one attention layer, the first layer a convolution;
    # the MLP's width adjusted as LFM2's (2/3 of 128, rounded up to a multiple of 32: 96)
    "lfm2": lambda: transformers.Lfm2Config(**_tiny(num_hidden_layers=4, tie_word_embeddings=True,
        layer_types=["conv", "conv", "full_attention", "conv"], conv_L_cache=3, block_multiple_of=32)),
    # attention sinks, every other layer sliding (llama.cpp's fixed gpt-oss pattern), biases everywhere,
    # YaRN over an original context of 32 (truncate left at transformers' default, True, which is what
    # ggml computes; the Hub's false is tested on its own); transformers runs it eagerly (no SDPA)
    "gpt_oss": lambda: transformers.GptOssConfig(**_tiny(num_hidden_layers=4, intermediate_size=64,
        tie_word_embeddings=False, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
        num_local_experts=8, num_experts_per_tok=2, attention_bias=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "beta_fast": 8.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 32})),
}


def _model_class(config) -> Callable[[transformers.PretrainedConfig], torch.nn.Module]:
    if isinstance(config, transformers.Mistral3Config):
        return transformers.Mistral3ForConditionalGeneration
    return transformers.AutoModelForCausalLM.from_config


def build(arch: str, directory, hub_layout: bool = False, head_dim: int | None = None) -> torch.nn.Module:
    """Save the tiny `arch` model in `directory`; return it (eval, float32). Run on input_ids
    alone, every returned model (mistral3's wrapper too) gives the text logits.

    `hub_layout` rewrites what transformers 5 saves differently from the published
    checkpoints (today only granitemoehybrid's layer_types, back to "attention"/"mamba").
    `head_dim` widens the heads (to a size the CUDA decode kernel is built for)."""
    config = ARCHITECTURES[arch]()
    if head_dim is not None:
        config.head_dim = head_dim
    model = save_tiny(directory, config, _model_class(config), [VOCAB - 1, 7])
    if hub_layout:
        path = os.path.join(directory, "config.json")
        with open(path) as f:
            saved = json.load(f)
        if "layer_types" in saved and saved.get("model_type") == "granitemoehybrid":
            legacy = {"full_attention": "attention", "linear_attention": "mamba"}
            saved["layer_types"] = [legacy.get(t, t) for t in saved["layer_types"]]
            with open(path, "w") as f:
                json.dump(saved, f, indent=2)
    return model.float().eval()
