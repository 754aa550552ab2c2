"""The numbers of the architectures with experts and of DeepSeek's latent
attention, read from a config.json or GGUF metadata (architectures.py's
``read_hf`` / ``read_gguf`` of their rows)."""
from __future__ import annotations

import math
from typing import Any

from .layer_kinds import LatentConfig, MoEConfig


def alternating(n: int) -> tuple[str, ...]:
    """Every other layer slides, the first among them (gpt-oss, and llama.cpp's gemma2)."""
    return tuple("sliding" if i % 2 == 0 else "full" for i in range(n))


def deepseek2_gguf(get, base: dict) -> dict[str, Any]:
    # llama.cpp: MQA with one KV head whose key is the cache entry (key_length = kv_lora_rank + rope),
    # the per-head sizes under *_mla; YaRN's mscale² on the scores from its log multiplier (and none
    # on cos/sin: llama.cpp cancels it, transformers' mscale / mscale_all_dim is 1)
    rope, lora = int(get("rope.dimension_count")), int(get("attention.kv_lora_rank"))
    latent = LatentConfig(int(get("attention.q_lora_rank", 0)), lora, int(get("attention.key_length_mla")) - rope,
                          rope, int(get("attention.value_length_mla")))
    scale, factor = (latent.nope_dim + rope) ** -0.5, float(get("rope.scaling.factor") or 1.0)
    if get("rope.scaling.yarn_log_multiplier") and factor > 1:
        scale *= (1.0 + float(get("rope.scaling.yarn_log_multiplier")) * math.log(factor)) ** 2
    n, width = int(get("block_count")), int(get("expert_feed_forward_length"))
    moe = MoEConfig(int(get("expert_count")), int(get("expert_used_count")), width,
                    scoring="sigmoid" if get("expert_gating_func") == 2 else "softmax",
                    norm_topk_prob=bool(get("expert_weights_norm", False)),
                    routed_scaling=float(get("expert_weights_scale", 1.0)),
                    num_groups=int(get("expert_group_count", 1)), topk_groups=int(get("expert_group_used_count", 1)),
                    shared_intermediate_size=width * int(get("expert_shared_count", 0)),
                    dense_layers=tuple(i < int(get("leading_dense_block_count", 0)) for i in range(n)))
    out = {"latent": latent, "attention_scale": scale, "moe": moe}
    if (base.get("rope_scaling") or {}).get("rope_type") == "yarn":
        out["rope_scaling"] = {**base["rope_scaling"], "attention_factor": 1.0}
    return out


def qwen3_moe_hf(cfg: dict, base: dict) -> dict[str, Any]:
    n, step = cfg["num_hidden_layers"], cfg.get("decoder_sparse_step") or 1
    only = set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i in only or (i + 1) % step != 0 for i in range(n))
    experts = cfg.get("num_experts") or cfg["num_local_experts"]   # the Hub's name, transformers 5's
    return {"moe": MoEConfig(experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                             norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), dense_layers=dense)}


def grouped_sigmoid_moe(cfg: dict) -> MoEConfig:
    """GLM-4.5's and DeepSeek V3's experts: sigmoid scores with a selection bias, chosen from the
    best groups, a shared expert; dense MLPs in the first `first_k_dense_replace` layers (or where
    GLM-4.7-Flash's mlp_layer_types says "dense")."""
    n, first = cfg["num_hidden_layers"], cfg.get("first_k_dense_replace") or 0
    kinds = cfg.get("mlp_layer_types")
    experts = cfg.get("n_routed_experts") or cfg["num_local_experts"]
    return MoEConfig(experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                     scoring="sigmoid", norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                     routed_scaling=float(cfg.get("routed_scaling_factor", 1.0)),
                     num_groups=cfg.get("n_group") or 1, topk_groups=cfg.get("topk_group") or 1,
                     shared_intermediate_size=cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0),
                     dense_layers=tuple(k == "dense" for k in kinds) if kinds else tuple(i < first for i in range(n)))


def glm4_moe_hf(cfg: dict, base: dict) -> dict[str, Any]:
    return {"moe": grouped_sigmoid_moe(cfg), "qk_norm": "head" if cfg.get("use_qk_norm") else None}


def deepseek_v3_hf(cfg: dict, base: dict) -> dict[str, Any]:
    latent = LatentConfig(cfg.get("q_lora_rank") or 0, cfg["kv_lora_rank"], cfg["qk_nope_head_dim"],
                          cfg["qk_rope_head_dim"], cfg["v_head_dim"], bool(cfg.get("rope_interleave", True)))
    # the softmax scale over the whole query head, times YaRN's mscale² where the config gives mscale_all_dim
    scale = (latent.nope_dim + latent.rope_dim) ** -0.5
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
        factor = float(rope["factor"])
        mscale = 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return {"moe": grouped_sigmoid_moe(cfg), "latent": latent, "attention_scale": scale,
            # the cache's one "head" is a token's entry; the rotary table is the rotary part's
            "num_kv_heads": 1, "head_dim": latent.kv_lora_rank + latent.rope_dim, "rotary_dim": latent.rope_dim}


def qwen3_moe_gguf(get, base: dict) -> dict[str, Any]:
    n = int(get("block_count"))
    return {"moe": MoEConfig(int(get("expert_count")), int(get("expert_used_count")),
                             int(get("expert_feed_forward_length")), dense_layers=(False,) * n)}


def glm4_moe_gguf(get, base: dict) -> dict[str, Any]:
    # the file also holds the multi-token-prediction layer(s) after the last one: not run
    n = int(get("block_count")) - int(get("nextn_predict_layers", 0))
    first, shared = int(get("leading_dense_block_count", 0)), int(get("expert_shared_count", 0))
    width = int(get("expert_feed_forward_length"))
    return {"num_layers": n,
            "moe": MoEConfig(int(get("expert_count")), int(get("expert_used_count")), width, scoring="sigmoid",
                             norm_topk_prob=bool(get("expert_weights_norm", True)),
                             routed_scaling=float(get("expert_weights_scale", 1.0)),
                             num_groups=int(get("expert_group_count", 1)),
                             topk_groups=int(get("expert_group_used_count", 1)),
                             shared_intermediate_size=width * shared,
                             dense_layers=tuple(i < first for i in range(n)))}


def granite_moe(experts: int, used: int, width: int, shared: int, n: int) -> MoEConfig:
    """Granite's experts (GraniteMoeHybrid's block_sparse_moe): a softmax over the top k logits,
    every layer, beside the shared MLP (the shared expert, `shared` wide, ungated)."""
    return MoEConfig(experts, used, width, scoring="softmax_topk", norm_topk_prob=False,
                     shared_intermediate_size=shared, dense_layers=(False,) * n)


def gpt_oss_moe(experts: int, used: int, width: int, n: int) -> MoEConfig:
    return MoEConfig(experts, used, width, scoring="softmax_topk", norm_topk_prob=False,
                     router_linear_bias=True, expert_bias=True, dense_layers=(False,) * n)


def gpt_oss_hf(cfg: dict, base: dict) -> dict[str, Any]:
    n = cfg["num_hidden_layers"]
    out = {"moe": gpt_oss_moe(cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"], n),
           "swiglu_alpha": float(cfg.get("swiglu_alpha") or 1.702),
           "swiglu_limit": float(cfg.get("swiglu_limit") or 7.0)}
    if not cfg.get("layer_types") and cfg.get("sliding_window"):   # GptOssConfig's default pattern
        out.update(layer_types=alternating(n), sliding_window=cfg["sliding_window"])
    return out


def gpt_oss_gguf(get, base: dict) -> dict[str, Any]:
    # llama.cpp: every other layer slides (its swa pattern 2); the clamped SwiGLU's α and limit are
    # its constants 1.702 and 7.0, ModelConfig's defaults
    n = int(get("block_count"))
    return {"layer_types": alternating(n),
            "moe": gpt_oss_moe(int(get("expert_count")), int(get("expert_used_count")),
                                int(get("expert_feed_forward_length")), n)}
