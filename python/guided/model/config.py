"""The model's shape and numerics, from an HF config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# HF `architectures` entries → our family names
_HF_ARCH = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        arch = _hf_architecture(cfg)
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_hf_rope_theta(cfg),
            rope_scaling=_hf_rope_scaling(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # qwen2 always has q/k/v bias; llama and qwen3 say so in the config
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_list(eos),
        )

    @classmethod
    def from_gguf(cls, md: dict) -> "ModelConfig":
        arch = md["general.architecture"]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

        def get(key, default=None):
            return md.get(f"{arch}.{key}", default)

        heads = get("attention.head_count")
        hidden = get("embedding_length")
        head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads
        vocab = get("vocab_size") or len(md["tokenizer.ggml.tokens"])
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=int(hidden),
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=int(heads),
            num_kv_heads=int(get("attention.head_count_kv") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(md, arch),
            max_position_embeddings=int(get("context_length", 4096)),
            tie_word_embeddings=False,  # decided by the loader: no output.weight → tied
            attention_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_as_list(md.get("tokenizer.ggml.eos_token_id")),
        )


def _hf_architecture(cfg: dict) -> str:
    for name in cfg.get("architectures") or ():
        if name in _HF_ARCH:
            return _HF_ARCH[name]
    model_type = cfg.get("model_type")
    if model_type in SUPPORTED_ARCHITECTURES:
        return model_type
    named = (cfg.get("architectures") or [model_type])[0]
    raise ValueError(f"unsupported architecture {named!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _hf_rope_theta(cfg: dict) -> float:
    # transformers 5 moved rope_theta into rope_parameters
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _hf_rope_scaling(cfg: dict) -> dict | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("llama3", "linear"):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return dict(scaling, rope_type=kind)


def _gguf_rope_scaling(md: dict, arch: str) -> dict | None:
    # llama.cpp bakes llama3 scaling into a rope_freqs tensor instead; the loader reads that.
    kind = md.get(f"{arch}.rope.scaling.type")
    factor = md.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    return None


def _as_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]
