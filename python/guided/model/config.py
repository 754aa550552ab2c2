"""The model's shape and numerics, from an HF config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .architectures import Architecture, architecture, for_gguf, for_hf
from .layer_kinds import DeltaNetConfig, LatentConfig, MambaConfig, MoEConfig, QkNorm


@dataclass
class ModelConfig:
    architecture: str            # a row of architectures.ARCHITECTURES
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
    attention_bias: bool = False     # q, k and v have biases
    output_bias: bool = False        # o_proj has one
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    #: the leading part of each head that rotates (Phi-4-mini: three quarters)
    rotary_dim: int | None = None
    #: per layer, "full", "sliding" (attends to the last `sliding_window` positions), "conv"
    #: (a gated short convolution instead of attention: LFM2), "mamba" / "delta" (a recurrent
    #: mixer instead), "hybrid" (attention and a Mamba-2 mixer side by side: Falcon-H1) or "mlp"
    #: (an MLP alone: Nemotron-H)
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    #: per layer, the rotary table it uses: "global", "local" (Gemma 3's sliding layers) or None
    rope_layers: tuple[str | None, ...] | None = None
    local_rope_theta: float | None = None
    embedding_multiplier: float = 1.0
    attention_scale: float | None = None   # None: head_dim ** -0.5
    residual_multiplier: float = 1.0
    logit_multiplier: float = 1.0
    attn_softcap: float | None = None      # scores → cap·tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None
    moe: MoEConfig | None = None
    qk_norm: QkNorm | None = None          # the architecture's, or the config's (GLM's use_qk_norm)
    swiglu_alpha: float = 1.702            # the "swiglu_oai" activation's sigmoid gain and clamp (gpt-oss)
    swiglu_limit: float = 7.0
    #: multi-head latent attention in every layer (DeepSeek V3); head_dim is then its cache entry's width
    latent: LatentConfig | None = None
    #: the Mamba-2 mixer of the "mamba" layers (Granite 4.0-H), the Gated DeltaNet of the "delta" ones (Qwen3.5)
    mamba: MambaConfig | None = None
    delta: DeltaNetConfig | None = None
    conv_kernel: int = 0                   # a "conv" layer's kernel size (LFM2's conv_L_cache)
    conv_bias: bool = False
    #: per layer module (the loaders' names: "q_proj", "mamba_in_proj", ...), multipliers the
    #: checkpoint applies around it, folded into its weights at load: (the input's, and the
    #: outputs' as runs of (rows, factor) down the weight; -1 rows: the rest) (Falcon-H1's µP
    #: multipliers, as llama.cpp's converter folds them)
    weight_scales: dict[str, tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=dict)

    def __post_init__(self):
        self.rotary_dim = self.rotary_dim or self.head_dim
        self.layer_types = tuple(self.layer_types or ("full",) * self.num_layers)
        self.rope_layers = tuple(self.rope_layers or ("global",) * self.num_layers)
        if self.attention_scale is None:
            self.attention_scale = self.head_dim ** -0.5
        if len(self.layer_types) != self.num_layers or len(self.rope_layers) != self.num_layers:
            raise ValueError(f"{self.architecture}: layer_types or rope layers do not name "
                             f"all {self.num_layers} layers")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ValueError(f"{self.architecture}: sliding layers without a sliding_window")
        if "linear" in self.layer_types:
            raise ValueError(f"{self.architecture}: linear-attention / recurrent layers are not supported "
                             f"for this architecture (guided runs those of Granite 4.0-H, Nemotron-H, Falcon-H1, "
                             f"Qwen3.5, Qwen3-Next and LFM2)")
        if unknown := sorted(set(self.layer_types) - set(LAYER_KINDS)):
            raise ValueError(f"{self.architecture}: layers of kind {', '.join(unknown)} are not supported here")
        if {"mamba", "hybrid"} & set(self.layer_types) and self.mamba is None or \
                "delta" in self.layer_types and self.delta is None:
            raise ValueError(f"{self.architecture}: recurrent layers without their mixer's numbers")
        if "mlp" in self.layer_types and not self.arch.one_sublayer:
            raise ValueError(f"{self.architecture}: MLP-only layers in an architecture whose layers have a mixer")
        if "conv" in self.layer_types and self.conv_kernel < 1:
            raise ValueError(f"{self.architecture}: convolution layers without a kernel size")

    @property
    def arch(self) -> Architecture:
        return architecture(self.architecture)

    def is_moe(self, layer: int) -> bool:
        return self.moe is not None and not self.moe.dense_layers[layer]

    def is_conv(self, layer: int) -> bool:
        return self.layer_types[layer] == "conv"

    def is_mamba(self, layer: int) -> bool:
        """A Mamba-2 mixer: alone ("mamba"), or beside attention on the same input ("hybrid": Falcon-H1)."""
        return self.layer_types[layer] in ("mamba", "hybrid")

    def attends(self, layer: int) -> bool:
        """Attention (or latent attention) in the layer: alone, or beside a Mamba-2 mixer."""
        return self.layer_types[layer] in ("full", "sliding", "hybrid")

    def has_mixer(self, layer: int) -> bool:
        """Whether the layer mixes tokens (attention, a convolution, a recurrent mixer): all but "mlp" layers."""
        return self.layer_types[layer] != "mlp"

    def has_mlp(self, layer: int) -> bool:
        """Whether the layer has an MLP (or experts) after its mixer: every layer, but where the
        architecture's layers are one sublayer each (Nemotron-H), only the "mlp" ones."""
        return not self.arch.one_sublayer or not self.has_mixer(layer)

    def is_recurrent(self, layer: int) -> bool:
        """A layer whose state is not per token (Mamba-2, Gated DeltaNet): a StatePool row."""
        return self.layer_types[layer] in ("mamba", "delta", "hybrid")

    @property
    def state_shape(self) -> tuple[int, ...] | None:
        """One recurrent layer's state of one sequence (None: the model has none)."""
        if self.mamba is not None:
            return self.mamba.heads, self.mamba.head_dim, self.mamba.state_size
        if self.delta is not None:
            return self.delta.v_heads, self.delta.k_dim, self.delta.v_dim
        return None

    def window(self, layer: int) -> int | None:
        """How many positions layer `layer` attends to (None: all)."""
        return self.sliding_window if self.layer_types[layer] == "sliding" else None

    @classmethod
    def from_hf(cls, raw: dict) -> "ModelConfig":
        arch = for_hf(raw)
        # a multimodal checkpoint's text model (Mistral 3, Gemma 3): its own config, text only
        cfg = {**raw, **raw["text_config"]} if isinstance(raw.get("text_config"), dict) else raw
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // heads
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        types = cfg.get("layer_types") or cfg.get("layers_block_type")   # (Nemotron-H's name)
        if types:
            other = sorted(set(types) - set(_LAYER_TYPES))
            if other:
                raise ValueError(f"{arch.name}: layers of kind {', '.join(other)} are not supported "
                                 f"(guided runs layers of kind: {', '.join(_LAYER_TYPES)})")
            types = tuple(_LAYER_TYPES[t] for t in types)
        elif window and arch.sliding_everywhere:
            types = ("sliding",) * cfg["num_hidden_layers"]
        bias = bool(cfg.get("attention_bias", False) or cfg.get("use_bias", False))
        fields = dict(
            architecture=arch.name,
            qk_norm=arch.qk_norm,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg.get("intermediate_size") or cfg.get("shared_intermediate_size"),
            num_layers=cfg.get("num_hidden_layers") or len(types or ()),
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_hf_rope_theta(cfg),
            rope_scaling=_hf_rope_scaling(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
            attention_bias=arch.qkv_bias or bias,
            output_bias=bias and arch.output_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False) or cfg.get("use_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_list(cfg.get("eos_token_id")),
            rotary_dim=int(head_dim * _partial_rotary(cfg)),
            layer_types=types or None,
            sliding_window=window if types and "sliding" in types else None,
        )
        fields.update({k: v for k, v in arch.read_hf(cfg, fields).items() if v is not None})
        return cls(**fields)

    @classmethod
    def from_gguf(cls, md: dict) -> "ModelConfig":
        name = md["general.architecture"]
        arch = for_gguf(name)

        def get(key, default=None):
            return md.get(f"{name}.{key}", default)

        heads = get("attention.head_count")
        hidden = get("embedding_length")
        head_dim = get("attention.key_length") or hidden // heads
        vocab = get("vocab_size") or len(md["tokenizer.ggml.tokens"])
        window = get("attention.sliding_window")
        kv_heads = get("attention.head_count_kv") or heads
        if isinstance(kv_heads, (list, tuple)):   # per layer (Granite 4, LFM2): all attention layers alike
            # LFM2's and Granite 4.0-H's readers name their 0s (convolution and Mamba layers)
            if len(set(kv_heads)) != 1 and not get("shortconv.l_cache") and not get("ssm.conv_kernel"):
                raise ValueError(f"{name}: layers with different KV head counts {sorted(set(kv_heads))} "
                                 f"(recurrent layers) are not supported")
            kv_heads = max(kv_heads)
        fields = dict(
            architecture=arch.name,
            qk_norm=arch.qk_norm,     # or the loader's, where the file holds q/k norms
            vocab_size=int(vocab),
            hidden_size=int(hidden),
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=int(heads),
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(md, name),
            max_position_embeddings=int(get("context_length", 4096)),
            tie_word_embeddings=False,  # decided by the loader: no output.weight → tied
            attention_bias=arch.qkv_bias,   # the loader sets it where the file holds biases
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_as_list(md.get("tokenizer.ggml.eos_token_id")),
            rotary_dim=int(get("rope.dimension_count") or head_dim),
            layer_types=("sliding",) * int(get("block_count")) if window and arch.sliding_everywhere else None,
            sliding_window=int(window) if window else None,
        )
        fields.update({k: v for k, v in arch.read_gguf(get, fields).items() if v is not None})
        if "sliding" not in (fields["layer_types"] or ()):
            fields["sliding_window"] = None
        return cls(**fields)


#: config.json's layer kinds (GraniteMoeHybrid says "attention"; "mamba" and others are refused)
_LAYER_TYPES = {"full_attention": "full", "attention": "full", "sliding_attention": "sliding", "conv": "conv",
                # recurrent: Granite 4's "mamba" (transformers 5 says "linear_attention"), which the
                # architecture's reader takes as Mamba-2 layers where it has them
                "mamba": "linear", "linear_attention": "linear",
                # an MLP alone (Nemotron-H's blocks; architectures whose layers are one sublayer each),
                # or experts alone (Nemotron 3's: its reader makes them MLP layers with experts)
                "mlp": "mlp", "moe": "moe"}
#: the layer kinds a ModelConfig holds (after its architecture's reader)
LAYER_KINDS = ("full", "sliding", "conv", "mamba", "delta", "hybrid", "mlp")


def _partial_rotary(cfg: dict) -> float:
    return float(cfg.get("partial_rotary_factor") or _rope_params(cfg).get("partial_rotary_factor") or 1.0)


def _rope_params(cfg: dict) -> dict:
    """The rotary parameters of the full-attention layers: transformers 5's
    rope_parameters (per layer type for Gemma 3), or the older rope_scaling."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return params.get("full_attention", params)


def _hf_rope_theta(cfg: dict) -> float:
    return float(cfg.get("rope_theta") or _rope_params(cfg).get("rope_theta") or 10000.0)


def _hf_rope_scaling(cfg: dict) -> dict | None:
    scaling = _rope_params(cfg)
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default" or (kind == "dynamic" and scaling.get("alpha")):   # Hunyuan's reader has it
        return None
    if kind not in ("llama3", "linear", "longrope", "yarn"):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    out = dict(scaling, rope_type=kind)
    if kind in ("longrope", "yarn"):
        out.setdefault("original_max_position_embeddings",
                       cfg.get("original_max_position_embeddings") or cfg.get("max_position_embeddings"))
        out["max_position_embeddings"] = cfg.get("max_position_embeddings")
    if kind == "yarn":
        out["truncate"] = bool(scaling.get("truncate", True))   # transformers' default
    return out


def _gguf_rope_scaling(md: dict, arch: str) -> dict | None:
    # llama.cpp bakes llama3 scaling into a rope_freqs tensor instead; the loader reads that.
    def get(key, default=None):
        return md.get(f"{arch}.rope.scaling.{key}", default)

    kind, factor = get("type"), get("factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor:
        # as ggml computes it: the correction range always rounded outwards (transformers'
        # truncate=True), the attention factor llama.cpp's multiplier of 1 + 0.1·ln(factor)
        return {"rope_type": "yarn", "factor": float(factor), "truncate": True,
                "original_max_position_embeddings": int(get("original_context_length")),
                "beta_fast": float(get("yarn_beta_fast", 32.0)), "beta_slow": float(get("yarn_beta_slow", 1.0)),
                "extrapolation_factor": _unset_below_zero(get("yarn_ext_factor"), 1.0),
                "attention_multiplier": float(get("yarn_attn_factor", 1.0))}
    if kind not in (None, "none", "linear", "longrope"):   # LongRoPE's factors are tensors (the loader)
        raise ValueError(f"{arch}: unsupported rope scaling {kind!r} in the GGUF")
    return None


def _unset_below_zero(value, default: float) -> float:
    """llama.cpp's convention for its YaRN keys: absent or negative means the default."""
    return default if value is None or float(value) < 0 else float(value)


def _as_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]
