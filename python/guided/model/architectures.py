"""The architectures guided runs: one row each, saying how it differs from Llama's decoder.

A new architecture whose layers are attention and an MLP is a row here (and,
where its config names a number no other architecture has, a reader for
it); decoder.py, the loaders and the tensor-parallel split read the row.
What each field means:

- ``norms``: where a layer's norms sit. "pre" (Llama): norm → sublayer →
  add. "post" (OLMo 2, EXAONE 4): sublayer → norm → add. "sandwich" (Gemma 2
  and 3): norm → sublayer → norm → add. "parallel" (Cohere 2): one norm, then
  attention and the MLP side by side on it, both added to the residual.
- ``norm_kind``: "rms" (RMSNorm) or "layer" (a LayerNorm without bias: the
  mean subtracted first, Cohere's).
- ``qk_norm``: RMSNorm on queries and keys (a config may turn it on, GLM's
  use_qk_norm): "head" (per head, Qwen3) or
  "full" (over all heads at once, OLMo 2); ``qk_norm_after_rope`` where it
  comes after the rotation (Hunyuan).
- ``norm_offset``: checkpoints store w where the norm multiplies by (offset +
  w) (Gemma's 1 + w); the HF loader adds it once, as llama.cpp's converter
  does, so the forward multiplies by the weight alone.
- ``interleaved_rope``: the checkpoint rotates pairs (x0, x1), (x2, x3)
  rather than halves (Ernie 4.5); the loader permutes Q/K rows to halves,
  which leaves every q·k unchanged.
- ``gguf_permuted_qk``: llama.cpp's converter interleaved the Q/K rows (its
  LlamaModel subclasses); the GGUF loader undoes it.
- ``sliding_everywhere``: a ``sliding_window`` without ``layer_types``
  applies to every layer (Mistral, Phi-3).
- ``activation``: the gated MLP's f(gate, up): "silu" (f = silu(gate)·up),
  "gelu_tanh" (Gemma), or "swiglu_oai" (gpt-oss: gate clamped above and up
  on both sides at ModelConfig.swiglu_limit, then (up + 1)·gate·σ(α·gate)).
- ``ungated``: the MLP has no gate, down(f(up(x))), with this f: "relu2",
  ReLU squared (Nemotron-H).
- ``one_sublayer``: each layer is a mixer or an MLP, not both, behind its one
  norm (Nemotron-H's blocks): "mlp" layers hold the MLP alone, the others
  their mixer alone.
- ``sinks``: each head has a learned logit that joins its attention
  softmax and is dropped after (gpt-oss's attention sinks): a per-layer
  parameter ``sinks`` [heads]; those layers attend in plain torch.
- ``hf_experts``: how transformers' stacked expert tensors are laid out:
  "concat" ([E, 2I, H], gate rows then up rows: Qwen3-MoE, GLM) or
  "interleaved" (gpt-oss: [E, H, 2I] with gate and up in alternate columns,
  down [E, I, H]); the HF loader turns them into ours.
- ``read_hf`` / ``read_gguf``: the architecture's own numbers (multipliers,
  soft-caps, which layers rotate) as ModelConfig fields; ``read_hf`` gets the
  config.json and the fields read so far, ``read_gguf`` a getter of the
  architecture's metadata keys and the fields read so far (the readers of
  experts and latent attention are in moe_readers.py, the hybrid rows' in hybrid_readers.py).

Layers other than attention, by ``layer_types``: "conv" (LFM2), a gated short
convolution whose inputs the paged cache holds per token (model/short_conv.py);
"mamba" (Granite 4.0-H) and "delta" (Qwen3.5 and Qwen3-Next, whose attention layers also gate
their output: ``attention_gate``), Mamba-2 and Gated DeltaNet mixers
(model/mamba.py, delta_net.py) whose state lives in a slot per sequence,
snapshots of it serving the prefix cache (model/state_pool.py). A row with a
``latent`` config (DeepSeek V3, Kimi K2, GLM-4.7-Flash) attends with
multi-head latent attention (model/latent_attention.py). Nemotron-H's blocks
are one sublayer each (``one_sublayer``): Mamba-2, attention without rotation,
a relu² MLP, or (Nemotron 3's "E" blocks) experts without a gate. Falcon-H1's
layers are "hybrid": attention and a Mamba-2 mixer side by side on the layer's
normed input, their outputs summed, its µP multipliers folded into the weights
at load (ModelConfig.weight_scales). "linear" layers of other architectures are
refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from .hybrid_readers import (falcon_h1_gguf, falcon_h1_hf, granite_mamba, lfm2_gguf, lfm2_hf, nemotron_h_hf,
                             qwen3_5_hf, qwen35_gguf)
from .layer_kinds import Activation, MambaConfig, NormKind, NormPlacement, QkNorm, UngatedActivation, check_feature
from .moe_readers import (alternating, deepseek2_gguf, deepseek_v3_hf, glm4_moe_gguf, glm4_moe_hf, gpt_oss_gguf,
                          gpt_oss_hf, granite_moe, qwen3_moe_gguf, qwen3_moe_hf)


def _none(*_) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Architecture:
    name: str
    hf_names: tuple[str, ...]
    gguf_names: tuple[str, ...] = ()
    norms: NormPlacement = "pre"
    norm_kind: NormKind = "rms"
    qk_norm: QkNorm | None = None
    qk_norm_after_rope: bool = False
    qkv_bias: bool = False          # always, whatever the config says (Qwen2)
    output_bias: bool = True        # o_proj has a bias where q, k and v have (not in Qwen2, GLM)
    activation: Activation = "silu"
    ungated: UngatedActivation | None = None
    one_sublayer: bool = False
    norm_offset: float = 0.0
    interleaved_rope: bool = False
    gguf_permuted_qk: bool = False
    sliding_everywhere: bool = False
    sinks: bool = False
    #: attention's output is gated per channel by σ of a second half of each query head (Qwen3.5)
    attention_gate: bool = False
    hf_experts: str = "concat"
    #: llama.cpp names whose role differs for this architecture (GLM-4.5's MLP input norm is its
    #: "post_attention_norm"), as (the usual role, this architecture's role)
    gguf_roles: tuple[tuple[str, str], ...] = ()
    read_hf: Callable[[dict, dict], dict[str, Any]] = _none
    read_gguf: Callable[[Callable, dict], dict[str, Any]] = _none

    def __post_init__(self):
        for field, kind in (("norms", NormPlacement), ("norm_kind", NormKind), ("qk_norm", QkNorm),
                            ("activation", Activation), ("ungated", UngatedActivation)):
            check_feature(f"{self.name}: {field}", getattr(self, field), kind)


# ---------------------------------------------------------------- the architectures' own numbers

def _granite_hf(cfg: dict, base: dict) -> dict[str, Any]:
    # GraniteMoeHybrid's position_embedding_type "nope": no layer rotates
    nope = cfg.get("position_embedding_type") == "nope"
    out = {"embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
           "attention_scale": float(cfg.get("attention_multiplier", 1.0)),
           "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
           "logit_multiplier": 1.0 / float(cfg.get("logits_scaling", 1.0)),
           "rope_layers": (None,) * cfg["num_hidden_layers"] if nope else None,
           # GraniteMoeHybrid's MLP is its shared_mlp, as wide as shared_intermediate_size
           # (intermediate_size is the experts' width, and may differ)
           "intermediate_size": cfg.get("shared_intermediate_size")}
    if cfg.get("num_local_experts"):
        out["moe"] = granite_moe(cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"],
                                 cfg.get("shared_intermediate_size") or 0, cfg["num_hidden_layers"])
    return {**out, **granite_mamba(cfg, base, out["rope_layers"] or base.get("rope_layers"))}


def _granite_gguf(get, base: dict) -> dict[str, Any]:
    return {"embedding_multiplier": float(get("embedding_scale", 1.0)),
            "attention_scale": float(get("attention.scale", 1.0)),
            "residual_multiplier": float(get("residual_scale", 1.0)),
            "logit_multiplier": 1.0 / float(get("logit_scale", 1.0))}


def _granite_hybrid_gguf(get, base: dict) -> dict[str, Any]:
    # llama.cpp: a KV head count per layer, 0 for the Mamba-2 layers; rope.scaling.finetuned false:
    # no layer rotates (4.0-H's NoPE); the biases are the loader's to find
    out = _granite_gguf(get, base)
    # the shared MLP's width (llama.cpp's converter writes intermediate_size, the experts' width, as
    # feed_forward_length)
    shared = int(get("expert_shared_feed_forward_length", 0))
    if shared:
        out["intermediate_size"] = shared
    if experts := get("expert_count", 0):
        out["moe"] = granite_moe(int(experts), int(get("expert_used_count")), int(get("feed_forward_length")),
                                 shared, int(get("block_count")))
    kv = get("attention.head_count_kv")
    if not isinstance(kv, (list, tuple)) or 0 not in kv:
        return out
    heads, inner = int(get("ssm.time_step_rank")), int(get("ssm.inner_size"))
    types = tuple("mamba" if k == 0 else "full" for k in kv)
    rotates = get("rope.scaling.finetuned", True)
    return {**out, "layer_types": types, "num_kv_heads": int(max(kv)),
            "rope_layers": tuple("global" if t == "full" and rotates else None for t in types),
            "mamba": MambaConfig(heads, inner // heads, int(get("ssm.state_size")), int(get("ssm.group_count", 1)),
                                 int(get("ssm.conv_kernel")))}


def _smollm3_hf(cfg: dict, base: dict) -> dict[str, Any]:
    # no_rope_layers[i] is 1 where layer i rotates
    flags = cfg.get("no_rope_layers") or [1] * cfg["num_hidden_layers"]
    return {"rope_layers": tuple("global" if f else None for f in flags)}


def _smollm3_gguf(get, base: dict) -> dict[str, Any]:
    # llama.cpp: every fourth layer has no rotation
    n, step = int(get("block_count")), int(get("no_rope_layer_step", 4))
    return {"rope_layers": tuple(None if (i + 1) % step == 0 else "global" for i in range(n))}


def _exaone4_hf(cfg: dict, base: dict) -> dict[str, Any]:
    # with a sliding window, the full-attention layers do not rotate
    if not cfg.get("sliding_window"):
        return {}
    types = cfg.get("layer_types") or ()
    return {"rope_layers": tuple("global" if t == "sliding_attention" else None for t in types) or None}


def _exaone4_gguf(get, base: dict) -> dict[str, Any]:
    pattern = get("attention.sliding_window_pattern")
    if not base["sliding_window"] or not pattern:
        return {}
    return {"layer_types": tuple("sliding" if p else "full" for p in pattern),
            "rope_layers": tuple("global" if p else None for p in pattern)}


def _hunyuan_hf(cfg: dict, base: dict) -> dict[str, Any]:
    # "dynamic" with a fixed alpha: a stretched base, the same at every length
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    alpha = rope.get("alpha")
    if not alpha:
        return {}
    dim = base["head_dim"]
    return {"rope_theta": base["rope_theta"] * float(alpha) ** (dim / (dim - 2))}


def _gemma_hf(cfg: dict, base: dict) -> dict[str, Any]:
    scalar = cfg.get("query_pre_attn_scalar") or cfg.get("head_dim")
    rope = cfg.get("rope_parameters") or {}
    local = (rope.get("sliding_attention") or {}).get("rope_theta") or cfg.get("rope_local_base_freq")
    types = cfg.get("layer_types") or ()
    return {"embedding_multiplier": math.sqrt(cfg["hidden_size"]),
            "attention_scale": float(scalar) ** -0.5,
            "attn_softcap": cfg.get("attn_logit_softcapping"),
            "final_softcap": cfg.get("final_logit_softcapping"),
            "local_rope_theta": float(local) if local else None,
            "rope_layers": tuple("local" if local and t == "sliding_attention" else "global"
                                 for t in types) or None}


def _cohere2_hf(cfg: dict, base: dict) -> dict[str, Any]:
    # the full-attention layers do not rotate
    types = base.get("layer_types") or ()
    return {"rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-5)), "logit_multiplier": float(cfg["logit_scale"]),
            "rope_layers": tuple("global" if t == "sliding" else None for t in types) or None}


def _cohere2_gguf(get, base: dict) -> dict[str, Any]:
    # llama.cpp: three sliding layers (which rotate), then a full one (which does not)
    n = int(get("block_count"))
    types = tuple("full" if (i + 1) % 4 == 0 else "sliding" for i in range(n))
    return {"rms_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5)),
            "logit_multiplier": float(get("logit_scale", 1.0)), "layer_types": types,
            "rope_layers": tuple("global" if t == "sliding" else None for t in types)}


def _gemma2_gguf(get, base: dict) -> dict[str, Any]:
    # llama.cpp: every other layer slides, the first among them
    n = int(get("block_count"))
    return {**_gemma_gguf(get, base), "layer_types": alternating(n)}


def _gemma3_gguf(get, base: dict) -> dict[str, Any]:
    # llama.cpp: five sliding layers, then a full one; the sliding layers rotate with their own base
    n = int(get("block_count"))
    types = tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(n))
    return {**_gemma_gguf(get, base), "layer_types": types,
            "local_rope_theta": float(get("rope.freq_base_swa", 10000.0)),
            "rope_layers": tuple("local" if t == "sliding" else "global" for t in types)}


def _gemma_gguf(get, base: dict) -> dict[str, Any]:
    # llama.cpp scales queries by head_dim ** -0.5 (its converter keeps no query_pre_attn_scalar)
    return {"embedding_multiplier": math.sqrt(base["hidden_size"]), "attention_scale": base["head_dim"] ** -0.5,
            "attn_softcap": get("attn_logit_softcapping"), "final_softcap": get("final_logit_softcapping")}


# ---------------------------------------------------------------- the table

#: llama.cpp's qwen35 names: the MLP's input norm is its "post_attention_norm" (as GLM's), and the
#: DeltaNet's q|k|v, convolution, norm, parameters and output take the names of phi3's fused
#: attention and of Mamba-2's tensors (gguf_loader's)
_QWEN35_GGUF_ROLES = (("attn_post_norm", "mlp_norm"), ("self_attn.qkv_proj", "delta_in_qkv"),
                      ("mamba_conv", "delta_conv"), ("mamba_norm", "delta_norm"), ("mamba", "linear_attn"),
                      ("mamba_out_proj", "delta_out_proj"))

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("llama", ("LlamaForCausalLM",), ("llama",), gguf_permuted_qk=True),
    Architecture("mistral", ("MistralForCausalLM", "Mistral3ForConditionalGeneration"), ("mistral3",),
                 gguf_permuted_qk=True, sliding_everywhere=True),
    Architecture("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), qkv_bias=True, output_bias=False),
    Architecture("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qk_norm="head"),
    Architecture("phi3", ("Phi3ForCausalLM",), ("phi3",), sliding_everywhere=True),
    Architecture("granite", ("GraniteForCausalLM",), ("granite",), gguf_permuted_qk=True,
                 read_hf=_granite_hf, read_gguf=_granite_gguf),
    Architecture("granitemoehybrid", ("GraniteMoeHybridForCausalLM", "GraniteMoeForCausalLM",
                                      "GraniteMoeSharedForCausalLM"), ("granitehybrid", "granitemoe"),
                 gguf_permuted_qk=True,
                 read_hf=_granite_hf, read_gguf=_granite_hybrid_gguf),
    Architecture("smollm3", ("SmolLM3ForCausalLM",), ("smollm3",), gguf_permuted_qk=True,
                 read_hf=_smollm3_hf, read_gguf=_smollm3_gguf),
    Architecture("olmo2", ("Olmo2ForCausalLM",), ("olmo2",), norms="post", qk_norm="full"),
    Architecture("exaone4", ("Exaone4ForCausalLM",), ("exaone4",), norms="post", qk_norm="head",
                 read_hf=_exaone4_hf, read_gguf=_exaone4_gguf),
    Architecture("ernie4_5", ("Ernie4_5ForCausalLM",), ("ernie4_5",), interleaved_rope=True),
    Architecture("hunyuan_v1_dense", ("HunYuanDenseV1ForCausalLM",), ("hunyuan-dense",), qk_norm="head",
                 qk_norm_after_rope=True, read_hf=_hunyuan_hf),
    Architecture("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3moe",), qk_norm="head",
                 read_hf=qwen3_moe_hf, read_gguf=qwen3_moe_gguf),
    Architecture("glm4_moe", ("Glm4MoeForCausalLM",), ("glm4moe",), output_bias=False,
                 gguf_roles=(("attn_post_norm", "mlp_norm"),),
                 read_hf=glm4_moe_hf, read_gguf=glm4_moe_gguf),
    Architecture("gpt_oss", ("GptOssForCausalLM",), ("gpt-oss",), activation="swiglu_oai", sinks=True,
                 hf_experts="interleaved", gguf_roles=(("attn_post_norm", "mlp_norm"),),
                 read_hf=gpt_oss_hf, read_gguf=gpt_oss_gguf),
    Architecture("cohere2", ("Cohere2ForCausalLM",), ("cohere2",), norms="parallel", norm_kind="layer",
                 interleaved_rope=True, read_hf=_cohere2_hf, read_gguf=_cohere2_gguf),
    Architecture("deepseek_v3", ("DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM"), ("deepseek2",), output_bias=False,
                 read_hf=deepseek_v3_hf, read_gguf=deepseek2_gguf),
    Architecture("qwen3_5_text", ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                                  "Qwen3_5MoeForConditionalGeneration"), ("qwen35", "qwen35moe"), qk_norm="head",
                 norm_offset=1.0, attention_gate=True, gguf_roles=_QWEN35_GGUF_ROLES,
                 read_hf=qwen3_5_hf, read_gguf=qwen35_gguf),
    # Qwen3.5's layers with Qwen3-Next's projections (Gated DeltaNet's grouped by key head)
    Architecture("qwen3_next", ("Qwen3NextForCausalLM",), ("qwen3next",), qk_norm="head", norm_offset=1.0,
                 attention_gate=True, gguf_roles=_QWEN35_GGUF_ROLES, read_hf=qwen3_5_hf, read_gguf=qwen35_gguf),
    Architecture("nemotron_h", ("NemotronHForCausalLM",), ungated="relu2", one_sublayer=True,
                 read_hf=nemotron_h_hf),
    Architecture("falcon_h1", ("FalconH1ForCausalLM",), ("falcon-h1",), read_hf=falcon_h1_hf, read_gguf=falcon_h1_gguf),
    Architecture("lfm2", ("Lfm2ForCausalLM",), ("lfm2",), qk_norm="head", read_hf=lfm2_hf, read_gguf=lfm2_gguf),
    Architecture("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), norms="sandwich", activation="gelu_tanh",
                 norm_offset=1.0, read_hf=_gemma_hf, read_gguf=_gemma2_gguf),
    Architecture("gemma3_text", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), ("gemma3",),
                 norms="sandwich", qk_norm="head", activation="gelu_tanh", norm_offset=1.0,
                 read_hf=_gemma_hf, read_gguf=_gemma3_gguf),
)

_BY_NAME = {a.name: a for a in ARCHITECTURES}
_BY_HF = {hf: a for a in ARCHITECTURES for hf in a.hf_names}
_BY_GGUF = {g: a for a in ARCHITECTURES for g in a.gguf_names}


def supported() -> str:
    """The architectures' HF names, for error messages and --help."""
    return ", ".join(hf for a in ARCHITECTURES for hf in a.hf_names)


def architecture(name: str) -> Architecture:
    return _BY_NAME[name]


def for_hf(cfg: dict) -> Architecture:
    """The row for a config.json: by its `architectures` entry, else its model_type."""
    for name in cfg.get("architectures") or ():
        if name in _BY_HF:
            return _BY_HF[name]
    if cfg.get("model_type") in _BY_NAME:
        return _BY_NAME[cfg["model_type"]]
    named = (cfg.get("architectures") or [cfg.get("model_type")])[0]
    raise ValueError(f"unsupported architecture {named!r}; guided runs: {supported()}")


def for_gguf(name: str) -> Architecture:
    if name in _BY_GGUF:
        return _BY_GGUF[name]
    raise ValueError(f"unsupported GGUF architecture {name!r}; guided runs: "
                     f"{', '.join(g for a in ARCHITECTURES for g in a.gguf_names)}")
