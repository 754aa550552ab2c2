"""The readers of the hybrid rows' own numbers (architectures.py): the layers beside
attention (LFM2's convolutions, Mamba-2, Gated DeltaNet) and how each architecture
arranges them, as ModelConfig fields from a config.json (and LFM2's GGUF metadata)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from .layer_kinds import DeltaNetConfig, MambaConfig, MoEConfig
from .moe_readers import qwen3_moe_hf


def granite_mamba(cfg: dict, base: dict, rope_layers) -> dict[str, Any]:
    """Granite 4.0-H's Mamba-2 layers (config.json's "mamba", transformers 5's "linear_attention")."""
    types = base.get("layer_types") or ()
    if "linear" not in types:
        return {}
    inner = int(cfg.get("mamba_expand", 2)) * cfg["hidden_size"]
    heads = int(cfg["mamba_n_heads"])
    head_dim = cfg.get("mamba_d_head")
    mamba = MambaConfig(heads, inner // heads if head_dim in (None, "auto") else int(head_dim),
                        int(cfg["mamba_d_state"]), int(cfg.get("mamba_n_groups", 1)), int(cfg.get("mamba_d_conv", 4)),
                        bool(cfg.get("mamba_conv_bias", True)), bool(cfg.get("mamba_proj_bias", False)),
                        *_time_step_limit(cfg))
    types = tuple("mamba" if t == "linear" else t for t in types)
    rope = rope_layers or ("global",) * len(types)
    return {"mamba": mamba, "layer_types": types,
            "rope_layers": tuple(None if t == "mamba" else r for t, r in zip(types, rope))}


def _time_step_limit(cfg: dict) -> tuple[float, float]:
    """Mamba-2's dt clamp (time_step_limit); transformers writes an infinite limit as {"__float__": "Infinity"}."""
    low, high = cfg.get("time_step_limit") or (0.0, "inf")
    return tuple(float(v["__float__"] if isinstance(v, dict) else v) for v in (low, high))


def lfm2_hf(cfg: dict, base: dict) -> dict[str, Any]:
    # the MLP's width is block_ff_dim adjusted as Lfm2MLP does: 2/3 of it, times a multiplier,
    # rounded up to a multiple of block_multiple_of
    width = cfg.get("block_ff_dim") or cfg["intermediate_size"]
    if cfg.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if cfg.get("block_ffn_dim_multiplier") is not None:
            step = int(cfg.get("block_multiple_of", 256))
            width = step * ((int(float(cfg["block_ffn_dim_multiplier"]) * width) + step - 1) // step)
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        full = set(cfg.get("full_attn_idxs") or range(n))
        types = ["full_attention" if i in full else "conv" for i in range(n)]
    types = tuple("conv" if t == "conv" else "full" for t in types)
    return {"intermediate_size": width, "rms_norm_eps": float(cfg.get("norm_eps", 1e-5)), "layer_types": types,
            "rope_layers": tuple(None if t == "conv" else "global" for t in types),
            "conv_kernel": int(cfg.get("conv_L_cache", 3)), "conv_bias": bool(cfg.get("conv_bias", False)),
            "tie_word_embeddings": bool(cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True)))}


def lfm2_gguf(get, base: dict) -> dict[str, Any]:
    # llama.cpp: a KV head count per layer, 0 for the convolution layers
    kv = get("attention.head_count_kv")
    types = tuple("conv" if k == 0 else "full" for k in kv)
    return {"layer_types": types, "rope_layers": tuple(None if t == "conv" else "global" for t in types),
            "num_kv_heads": int(max(kv)), "conv_kernel": int(get("shortconv.l_cache"))}


def qwen3_5_hf(cfg: dict, base: dict) -> dict[str, Any]:
    # Gated DeltaNet layers (config.json's "linear_attention") between gated attention layers
    types = tuple("delta" if t == "linear" else t for t in base.get("layer_types") or ())
    delta = DeltaNetConfig(cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                           cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]) if "delta" in types else None
    out = {"layer_types": types or None, "delta": delta,
           "rope_layers": tuple(None if t == "delta" else "global" for t in types) or None}
    if cfg.get("num_experts"):
        # Qwen3-Next's and Qwen3.5-MoE's experts: Qwen3-MoE's router (Qwen3.5-MoE always renormalises
        # the top k; its config says nothing), a shared expert gated by σ of a linear
        moe = qwen3_moe_hf({**cfg, "norm_topk_prob": cfg.get("norm_topk_prob") is not False}, base)["moe"]
        out["moe"] = replace(moe, shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                             shared_expert_gate=bool(cfg.get("shared_expert_intermediate_size")))
    return out


def falcon_h1_gguf(get, base: dict) -> dict[str, Any]:
    """llama.cpp's falcon-h1: every layer attention beside Mamba-2 (its sizes in the ssm keys), the
    µP multipliers already folded into the weights by the converter; the mixer's norm (its graph
    takes it after the gate) and biases by the tensors the file holds (gguf_loader)."""
    n, heads, inner = int(get("block_count")), int(get("ssm.time_step_rank")), int(get("ssm.inner_size"))
    return {"layer_types": ("hybrid",) * n, "rope_layers": ("global",) * n,
            "mamba": MambaConfig(heads, inner // heads, int(get("ssm.state_size")), int(get("ssm.group_count", 1)),
                                 int(get("ssm.conv_kernel")))}


def qwen35_gguf(get, base: dict) -> dict[str, Any]:
    """llama.cpp's qwen35, qwen35moe and qwen3next: the Gated DeltaNet's sizes in its ssm keys (the
    key heads as groups, k_dim as the state size, the value heads as the time-step rank), its value
    heads tiled (Qwen3.5's: the converter reorders them; Qwen3-Next's stay grouped), the recurrent
    layers listed or every full_attention_interval-th layer attending; multi-token-prediction
    layers after the last (not run)."""
    n = int(get("block_count")) - int(get("nextn_predict_layers", 0))
    recurrent = get("attention.recurrent_layers")
    if recurrent is None:
        interval = int(get("full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(n)]
    types = tuple("delta" if r else "full" for r in recurrent[:n])
    v_heads = int(get("ssm.time_step_rank"))
    delta = DeltaNetConfig(int(get("ssm.group_count")), v_heads, int(get("ssm.state_size")),
                           int(get("ssm.inner_size")) // v_heads, int(get("ssm.conv_kernel")),
                           tiled=base["architecture"] != "qwen3_next")
    out = {"num_layers": n, "layer_types": types, "delta": delta,
           "rope_layers": tuple(None if t == "delta" else "global" for t in types)}
    if get("expert_count"):
        shared = int(get("expert_shared_feed_forward_length", 0))
        out["moe"] = MoEConfig(int(get("expert_count")), int(get("expert_used_count")),
                               int(get("expert_feed_forward_length")), shared_intermediate_size=shared,
                               shared_expert_gate=bool(shared), dense_layers=(False,) * n)
    return out


#: Nemotron-H's hybrid_override_pattern: a character per block
_NEMOTRON_BLOCKS = {"M": "mamba", "*": "full", "-": "mlp", "E": "moe"}


def nemotron_h_hf(cfg: dict, base: dict) -> dict[str, Any]:
    # the blocks by the Hub configs' pattern, or transformers 5's layers_block_type (read as layer_types)
    pattern = cfg.get("hybrid_override_pattern")
    types = tuple(_NEMOTRON_BLOCKS[ch] for ch in pattern) if pattern else \
        tuple("mamba" if t == "linear" else t for t in base.get("layer_types") or ())
    mamba = MambaConfig(int(cfg["mamba_num_heads"]), int(cfg["mamba_head_dim"]), int(cfg["ssm_state_size"]),
                        int(cfg.get("n_groups", 1)), int(cfg.get("conv_kernel", 4)),
                        bool(cfg.get("use_conv_bias", True)), bool(cfg.get("use_bias", False)),
                        # dt floored at time_step_min, no upper limit: transformers' chunked scan (its
                        # prefill) does so, its one-token update not; here every step does
                        float(cfg.get("time_step_min", 0.0)), float("inf"))
    # Nemotron 3's expert blocks ("E"): MLP blocks whose MLP is experts without a gate (relu², as the
    # MLP's), DeepSeek V3's router (σ scores, a selection bias, groups), one shared expert beside
    moe = None
    if "moe" in types:
        latent = int(cfg.get("moe_latent_size") or 0)
        moe = MoEConfig(int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"]),
                        int(cfg["moe_intermediate_size"]), scoring="sigmoid",
                        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                        routed_scaling=float(cfg.get("routed_scaling_factor", 1.0)),
                        num_groups=int(cfg.get("n_group", 1)), topk_groups=int(cfg.get("topk_group", 1)),
                        shared_intermediate_size=int(cfg.get("moe_shared_expert_intermediate_size") or 0),
                        dense_layers=tuple(t != "moe" for t in types), ungated=True, latent_size=latent,
                        latent_bias=bool(cfg.get("mlp_bias", False)) and bool(latent),
                        shared_bias=bool(cfg.get("mlp_bias", False)))
    # transformers' attention has no biases whatever attention_bias says (use_bias is the mixer's)
    return {"layer_types": tuple("mlp" if t == "moe" else t for t in types), "num_layers": len(types),
            "mamba": mamba, "moe": moe, "rope_layers": (None,) * len(types),
            "rms_norm_eps": float(cfg.get("layer_norm_epsilon", 1e-5)), "attention_bias": False,
            "output_bias": False, "mlp_bias": bool(cfg.get("mlp_bias", False))}


def falcon_h1_hf(cfg: dict, base: dict) -> dict[str, Any]:
    # every layer runs attention and Mamba-2 side by side on one normed input, their outputs summed
    n, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    inner = cfg.get("mamba_d_ssm") or int(cfg.get("mamba_expand", 2)) * hidden
    heads = int(cfg["mamba_n_heads"])
    head_dim = cfg.get("mamba_d_head")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    norm = ("norm_then_gate" if cfg.get("mamba_norm_before_gate", True) else "gated") \
        if cfg.get("mamba_rms_norm", False) else "none"
    mamba = MambaConfig(heads, head_dim, int(cfg["mamba_d_state"]), int(cfg.get("mamba_n_groups", 1)),
                        int(cfg.get("mamba_d_conv", 4)), bool(cfg.get("mamba_conv_bias", True)),
                        bool(cfg.get("mamba_proj_bias", False)), *_time_step_limit(cfg), norm,
                        bool(cfg.get("projectors_bias", False)))
    # µP multipliers, folded into the weights they surround (transformers multiplies activations)
    attn_in, ssm_in = float(cfg.get("attention_in_multiplier", 1.0)), float(cfg.get("ssm_in_multiplier", 1.0))
    gate, down = cfg.get("mlp_multipliers") or (1.0, 1.0)
    z, x, b, c, dt = cfg.get("ssm_multipliers") or (1.0,) * 5
    groups = mamba.groups * mamba.state_size
    scales = {"q_proj": (attn_in, ((-1, 1.0),)),
              "k_proj": (attn_in, ((-1, float(cfg.get("key_multiplier", 1.0))),)),
              "v_proj": (attn_in, ((-1, 1.0),)),
              "o_proj": (1.0, ((-1, float(cfg.get("attention_out_multiplier", 1.0))),)),
              "mamba_in_proj": (ssm_in, ((inner, z), (inner, x), (groups, b), (groups, c), (heads, dt))),
              "mamba_out_proj": (1.0, ((-1, float(cfg.get("ssm_out_multiplier", 1.0))),)),
              "gate_proj": (1.0, ((-1, float(gate)),)), "down_proj": (1.0, ((-1, float(down)),))}
    return {"layer_types": ("hybrid",) * n, "rope_layers": ("global",) * n, "mamba": mamba,
            "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
            "logit_multiplier": float(cfg.get("lm_head_multiplier", 1.0)), "weight_scales": scales,
            "attention_bias": bool(cfg.get("attention_bias", False)),
            "output_bias": bool(cfg.get("attention_bias", False))}
