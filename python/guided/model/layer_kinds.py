"""What a layer kind needs beyond the row's flags: the numbers of a mixture of
experts, of latent attention, of a Mamba-2 mixer and of a Gated DeltaNet, read
from a config by the architecture's reader (architectures.py) and held by
ModelConfig."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

#: The feature values the executors read, declared once: the architecture rows
#: and MoEConfig are typed by them and checked against them (``check_feature``),
#: the native step's records (rust/bindings/python_native_step.rs) take the same
#: (tests/model/test_native_contract.py ties the two).
#: Where a layer's norms sit: "pre" (Llama), "post" (OLMo 2), "sandwich" (Gemma 2/3),
#: "parallel" (Cohere 2: one norm, attention and MLP side by side)
NormPlacement = Literal["pre", "post", "sandwich", "parallel"]
#: RMSNorm, or a LayerNorm without bias (Cohere)
NormKind = Literal["rms", "layer"]
#: q/k norms per head (Qwen3) or over all heads at once (OLMo 2)
QkNorm = Literal["head", "full"]
#: the gated MLP's activation: SiLU, tanh-approximated GELU (Gemma), gpt-oss's clamped SwiGLU
Activation = Literal["silu", "gelu_tanh", "swiglu_oai"]
#: an MLP without a gate, down(f(up(x))), and its f: squared ReLU (Nemotron-H); the torch step's only
UngatedActivation = Literal["relu2"]
#: how a Mamba-2 mixer's output y meets its gate z before out_proj: RMSNorm(y·SiLU(z)) ("gated":
#: Granite 4.0-H, Nemotron-H), RMSNorm(y)·SiLU(z) ("norm_then_gate") or y·SiLU(z) ("none"): Falcon-H1's
#: mamba_rms_norm and mamba_norm_before_gate choose
MambaNorm = Literal["gated", "norm_then_gate", "none"]
#: how a router's logits choose experts (MoEConfig.scoring)
Scoring = Literal["softmax", "softmax_topk", "sigmoid"]


def check_feature(field: str, value, kind) -> None:
    """ValueError naming ``field`` and ``value`` where ``value`` is not one of the Literal ``kind``'s."""
    if value is not None and value not in get_args(kind):
        raise ValueError(f"{field}: unknown {value!r} (one of {', '.join(get_args(kind))})")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: per token, a router picks `top_k` of
    `num_experts` gated MLPs (each `intermediate_size` wide) and sums their
    outputs by its weights, plus a shared expert where there is one."""
    num_experts: int
    top_k: int
    intermediate_size: int
    #: "softmax" (Qwen3-MoE: a softmax over all experts, then the top k), "sigmoid" with a
    #: selection bias (GLM-4.5), or "softmax_topk" (gpt-oss: the top k logits, then a softmax over them)
    scoring: Scoring = "softmax"
    norm_topk_prob: bool = True
    routed_scaling: float = 1.0
    num_groups: int = 1          # experts are chosen from the best `topk_groups` of these groups
    topk_groups: int = 1
    shared_intermediate_size: int = 0
    #: the shared expert's output times σ(a learned linear of the input) (Qwen3-Next, Qwen3.5-MoE)
    shared_expert_gate: bool = False
    #: per layer, whether it is a dense MLP instead (GLM's first layers, Qwen3-MoE's mlp_only_layers)
    dense_layers: tuple[bool, ...] = ()
    router_linear_bias: bool = False   # the router's linear layer has a bias (gpt-oss)
    expert_bias: bool = False          # each expert's gate|up and down have biases (gpt-oss)
    #: the experts (and the shared one) have no gate: down(f(up(x))) (Nemotron-H's, with relu²)
    ungated: bool = False
    #: the experts work in a latent of this width, projected in and out around them (0: none;
    #: Nemotron 3's moe_latent_size); the projections have biases where `latent_bias`
    latent_size: int = 0
    latent_bias: bool = False
    #: the shared expert's projections have biases (Nemotron-H's with mlp_bias)
    shared_bias: bool = False

    def __post_init__(self):
        check_feature("scoring", self.scoring, Scoring)


@dataclass(frozen=True)
class LatentConfig:
    """Multi-head latent attention (latent_attention.py): queries through a rank-`q_lora_rank`
    bottleneck (0: one projection), keys and values from a cached latent of `kv_lora_rank` values
    and a `rope_dim` rotary key shared by the heads; per head, `nope_dim` + `rope_dim` query and key
    values and `v_dim` value ones."""
    q_lora_rank: int
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    #: the checkpoint rotates pairs (transformers' rope_interleave); the loader permutes to halves
    interleaved: bool = True


@dataclass(frozen=True)
class MambaConfig:
    """A Mamba-2 mixer (model/mamba.py): `heads` heads of `head_dim` channels, each with a
    [head_dim, state_size] state; B and C in `groups` groups shared by the heads; a causal
    depthwise convolution of `conv_kernel` taps over x|B|C; dt clamped to [dt_min, dt_max]."""
    heads: int
    head_dim: int
    state_size: int
    groups: int
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False
    dt_min: float = 0.0
    dt_max: float = float("inf")
    norm: MambaNorm = "gated"
    #: whether out_proj has a bias (None: as in_proj, `proj_bias`; Falcon-H1's projectors_bias)
    out_bias: bool | None = None

    def __post_init__(self):
        check_feature("norm", self.norm, MambaNorm)

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """x, B and C: what the convolution mixes."""
        return self.inner + 2 * self.groups * self.state_size

    @property
    def cache_width(self) -> int:
        """What the paged cache keeps per token: the convolution's input and dt (in_proj's)."""
        return self.conv_dim + self.heads


@dataclass(frozen=True)
class DeltaNetConfig:
    """A Gated DeltaNet mixer (model/delta_net.py): `k_heads` query/key heads of `k_dim`, shared by
    groups of the `v_heads` value heads of `v_dim`, each value head with a [k_dim, v_dim] state;
    a causal depthwise convolution of `conv_kernel` taps over q|k|v."""
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    #: value head j reads key head j mod k_heads (llama.cpp's qwen35 files, reordered for ggml's
    #: broadcast), not j // (v_heads / k_heads) (the checkpoints' order)
    tiled: bool = False

    @property
    def key_dim(self) -> int:
        return self.k_heads * self.k_dim

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:
        """q, k and v: what the convolution mixes."""
        return 2 * self.key_dim + self.value_dim

    @property
    def cache_width(self) -> int:
        """What the paged cache keeps per token: the convolution's input, b and a (in_proj's)."""
        return self.conv_dim + 2 * self.v_heads
