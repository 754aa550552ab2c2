"""Loading an HF model directory: config.json, safetensors (single or sharded), tokenizer files."""
from __future__ import annotations

import json
import os
from typing import Callable

import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from .architectures import Architecture
from .config import ModelConfig
from .delta_net import delta_ungrouped
from .gguf_loader import _layer, latent_halves, unpermute
from .mxfp4 import dequantize_mxfp4
from .weights import WeightSink


def _read_json(directory: str, name: str) -> dict:
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _weight_files(directory: str) -> list[str]:
    index = _read_json(directory, "model.safetensors.index.json")
    if index:
        return sorted({os.path.join(directory, f) for f in index["weight_map"].values()})
    single = os.path.join(directory, "model.safetensors")
    if os.path.exists(single):
        return [single]
    shards = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not shards:
        raise FileNotFoundError(f"no .safetensors weights in {directory}")
    return [os.path.join(directory, f) for f in shards]


def hf_config(directory: str) -> tuple[ModelConfig, dict]:
    """The model's shape from its config.json, and the raw JSON."""
    raw = _read_json(directory, "config.json")
    if not raw:
        raise FileNotFoundError(f"{directory} has no config.json")
    return ModelConfig.from_hf(raw), raw


def load_hf(directory: str, dtype: torch.dtype, device: torch.device):
    config, raw = hf_config(directory)
    sink = WeightSink(config, dtype, device)
    files = _weight_files(directory)
    handles = [safe_open(f, framework="pt") for f in files]
    arch = config.arch
    for name, read in tqdm(_tensors(handles, dtype), desc="loading weights", unit="tensor", leave=False):
        ours = _our_name(name, arch)
        if ours is not None and _layer(ours) < config.num_layers:   # past the last: GLM's prediction layer
            sink.add(ours, _as_ours(ours, read(), arch, config))
    model = sink.build()
    model.init_rotary(device, dtype)
    return config, model, raw


def _tensors(handles, dtype: torch.dtype) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """Each checkpoint tensor's name and a reader of it. MXFP4 pairs (gpt-oss's Hub
    checkpoints: `experts.gate_up_proj_blocks` and `_scales`) come as one tensor under
    the parameter's name, dequantized and laid out as transformers holds it ([E, in, out])."""
    where = {name: h for h in handles for name in h.keys()}
    out = []
    for name, h in where.items():
        if name.endswith("_scales") and name.removesuffix("_scales") + "_blocks" in where:
            continue
        if name.endswith("_blocks"):
            stem = name.removesuffix("_blocks")
            if stem + "_scales" not in where:
                raise ValueError(f"{name}: MXFP4 blocks without their {stem}_scales")

            def read(h=h, name=name, s=where[stem + "_scales"], key=stem + "_scales"):
                return dequantize_mxfp4(h.get_tensor(name), s.get_tensor(key), dtype).transpose(-1, -2)
            out.append((stem, read))
        else:
            out.append((name, lambda h=h, name=name: h.get_tensor(name)))
    return out


#: where a multimodal checkpoint keeps its text model's tensors (Mistral 3, Gemma 3; transformers 5
#: saves "model.language_model.", earlier versions "language_model.model.")
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.",
                  "backbone.")   # Nemotron-H
_NOT_TEXT = ("vision_tower", "vision_model", "multi_modal_projector", "rotary_emb.", "visual.", "mtp.")
#: HF's per-layer module names that are not ours, by the architecture's norm placement
_NORMS = {
    "pre": {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
            "pre_ff_layernorm": "mlp_norm"},   # Falcon-H1's
    "parallel": {"input_layernorm": "attn_norm"},
    "post": {"post_attention_layernorm": "attn_post_norm", "post_feedforward_layernorm": "mlp_post_norm"},
    "sandwich": {"input_layernorm": "attn_norm", "post_attention_layernorm": "attn_post_norm",
                 "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "mlp_post_norm"},
}
_MODULES = {"query_layernorm": "q_norm", "key_layernorm": "k_norm",           # Hunyuan
            "mixer": "mamba",                                                 # Nemotron-H's A_log, D, dt_bias
            "input_linear": "gate_up_proj", "output_linear": "down_proj",     # Granite 4's shared MLP
            "q_a_layernorm": "q_a_norm", "kv_a_layernorm": "kv_a_norm",       # DeepSeek V3's latent attention
            "kv_a_proj_with_mqa": "kv_a_proj"}
#: modules named by their path in the layer, where the last name alone is ambiguous (LFM2's
#: conv.out_proj and self_attn.out_proj)
_PATHS = {"operator_norm": "attn_norm", "ffn_norm": "mlp_norm",
          "self_attn.q_layernorm": "q_norm", "self_attn.k_layernorm": "k_norm", "self_attn.out_proj": "o_proj",
          "feed_forward.w1": "gate_proj", "feed_forward.w3": "up_proj", "feed_forward.w2": "down_proj",
          "conv.in_proj": "conv_in_proj", "conv.out_proj": "conv_out_proj", "conv.conv": "conv",
          # Granite 4.0-H's Mamba-2 layers
          "mamba.in_proj": "mamba_in_proj", "mamba.out_proj": "mamba_out_proj", "mamba.conv1d": "mamba_conv",
          "mamba.norm": "mamba_norm",
          # Nemotron-H's: every block's sublayer is its "mixer" (these four in its Mamba-2 blocks)
          "mixer.in_proj": "mamba_in_proj", "mixer.out_proj": "mamba_out_proj", "mixer.conv1d": "mamba_conv",
          "mixer.norm": "mamba_norm",
          # Qwen3.5's Gated DeltaNet layers
          "linear_attn.in_proj_qkv": "delta_in_qkv", "linear_attn.in_proj_z": "delta_in_z",
          "linear_attn.in_proj_b": "delta_in_b", "linear_attn.in_proj_a": "delta_in_a",
          "linear_attn.conv1d": "delta_conv", "linear_attn.norm": "delta_norm",
          "linear_attn.out_proj": "delta_out_proj",
          # Qwen3-Next's, with q|k|v|z and b|a each in one projection, grouped by key head
          "linear_attn.in_proj_qkvz": "delta_in_qkvz", "linear_attn.in_proj_ba": "delta_in_ba"}
#: top-level tensors under another name (LFM2's final norm)
_TOP = {"embedding_norm.weight": "norm.weight",
        "embeddings.weight": "embed_tokens.weight", "norm_f.weight": "norm.weight",   # Nemotron-H's
        "final_layernorm.weight": "norm.weight"}                                         # Falcon-H1's


#: a mixture-of-experts MLP's tensors (after "mlp."): the router ("gate"), the experts, a shared expert
_MOE = {
    "gate": lambda rest: ["router_bias"] if rest == ["e_score_correction_bias"] else ["router"] + rest,
    "router": lambda rest: ["router"] + rest,                                  # gpt-oss (with a bias)
    "experts": lambda rest: ["experts"] + rest if rest[0].isdigit() else {
        "gate_up_proj": ["gate_up"], "down_proj": ["down"],                     # transformers 5 stacks them
        "up_proj": ["gate_up"],                                                  # (Nemotron-H's: up alone)
        "gate_up_proj_bias": ["gate_up_bias"], "down_proj_bias": ["down_bias"]}[rest[0]],
    "shared_experts": lambda rest: ["shared"] + rest,
    "shared_expert": lambda rest: ["shared"] + rest,
    "shared_expert_gate": lambda rest: ["shared_gate"],                      # Qwen3-Next, Qwen3.5-MoE
    "fc1_latent_proj": lambda rest: ["latent_in"] + rest,                    # Nemotron 3's latent
    "fc2_latent_proj": lambda rest: ["latent_out"] + rest,
}
#: Granite's experts (after "block_sparse_moe."), as the Hub's checkpoints name them and as
#: transformers 5 holds them
_GRANITE_MOE = {"input_linear.weight": "gate_up", "output_linear.weight": "down", "router.layer.weight": "router.weight",
                "experts.gate_up_proj": "gate_up", "experts.down_proj": "down", "router.weight": "router.weight"}


def _our_name(name: str, arch: Architecture) -> str | None:
    """An HF tensor name as WeightSink takes it, or None for what the text model does not use."""
    if any(part in name for part in _NOT_TEXT):
        return None
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    parts = name.split(".")
    if parts[0] == "layers" and ".".join(parts[2:-1]) in _PATHS:
        return f"layers.{parts[1]}.{_PATHS['.'.join(parts[2:-1])]}.{parts[-1]}"
    if parts[0] == "layers" and parts[-1] == "sinks":       # gpt-oss's self_attn.sinks
        return f"layers.{parts[1]}.sinks"
    if parts[0] == "layers" and len(parts) > 3:
        if parts[2] in ("mlp", "mixer") and parts[3] in _MOE:   # (Nemotron-H's blocks: "mixer")
            return ".".join(parts[:2] + ["moe"] + _MOE[parts[3]](parts[4:]))
        if parts[2] == "block_sparse_moe" and ".".join(parts[3:]) in _GRANITE_MOE:
            return f"layers.{parts[1]}.moe.{_GRANITE_MOE['.'.join(parts[3:])]}"
        module = parts[-2]
        parts[-2] = _NORMS[arch.norms].get(module) or _MODULES.get(module, module)
    return _TOP.get(name) or ".".join(parts)


def _as_ours(name: str, w: torch.Tensor, arch: Architecture, c: ModelConfig) -> torch.Tensor:
    """Gemma's norms store w for (1 + w); Ernie's Q/K rows rotate in pairs, ours in halves;
    gpt-oss's experts are [E, in, out] with gate and up in alternate columns, ours [E, out, in]
    with gate rows then up rows; LFM2's convolution is a Conv1d's [hidden, 1, kernel]."""
    if name.endswith("conv.weight") and w.dim() == 3:   # LFM2's and Mamba's Conv1d [channels, 1, kernel]
        return w.squeeze(1)
    if c.latent is not None and c.latent.interleaved and name.endswith(("q_proj.weight", "q_b_proj.weight",
                                                                         "kv_a_proj.weight")):
        return latent_halves(name, w, c)
    if arch.hf_experts == "interleaved" and name.endswith(("moe.gate_up", "moe.down")):
        w = w.transpose(-1, -2).contiguous()
    if arch.hf_experts == "interleaved" and name.endswith(("moe.gate_up", "moe.gate_up_bias")):
        return torch.cat([w[:, 0::2], w[:, 1::2]], dim=1)
    if name.endswith(("delta_in_qkvz.weight", "delta_in_ba.weight")):
        return delta_ungrouped(w, c.delta, name.split(".")[-2].removeprefix("delta_in_"))
    if arch.norm_offset and name.endswith("norm.weight") and not name.endswith("delta_norm.weight"):
        # (the DeltaNet's gated norm multiplies by its weight as stored)
        return w.float() + arch.norm_offset
    if c.weight_scales and (scale := c.weight_scales.get(name.split(".")[-2])) is not None:
        return scaled(w, *scale, bias=name.endswith(".bias"))
    if arch.interleaved_rope and name.endswith(("q_proj.weight", "q_proj.bias")):
        return unpermute(w, c.num_heads)
    if arch.interleaved_rope and name.endswith(("k_proj.weight", "k_proj.bias")):
        return unpermute(w, c.num_kv_heads)
    return w


def scaled(w: torch.Tensor, inputs: float, rows: tuple[tuple[int, float], ...], bias: bool = False) -> torch.Tensor:
    """A linear's weight (or bias) with multipliers of its input and of runs of its outputs folded
    in (ModelConfig.weight_scales); a bias takes the outputs' alone."""
    sizes = [n for n, _ in rows]
    if -1 in sizes:
        sizes[sizes.index(-1)] = w.shape[0] - sum(n for n in sizes if n != -1)
    if sum(sizes) != w.shape[0]:
        raise ValueError(f"multipliers for {sum(sizes)} rows of a weight of {w.shape[0]}")
    factor = torch.cat([torch.full((n,), f, dtype=torch.float32) for n, (_, f) in zip(sizes, rows)])
    out = w.float() * factor.view(-1, *(1,) * (w.dim() - 1))
    return (out if bias else out * inputs).to(w.dtype)


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
        return value.get("content")
    return value


def _ids(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


def hf_tokenizer_info(directory: str, config_json: dict) -> dict:
    tokenizer = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    tok_cfg = _read_json(directory, "tokenizer_config.json")
    gen_cfg = _read_json(directory, "generation_config.json")
    bos, eos = _token_text(tok_cfg.get("bos_token")), _token_text(tok_cfg.get("eos_token"))

    end_ids = _ids(gen_cfg.get("eos_token_id")) | _ids(config_json.get("eos_token_id"))
    if eos is not None and tokenizer.token_to_id(eos) is not None:
        end_ids.add(tokenizer.token_to_id(eos))

    template = tok_cfg.get("chat_template")
    jinja = os.path.join(directory, "chat_template.jinja")  # where transformers 5 saves it
    if template is None and os.path.exists(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    if isinstance(template, list):  # named templates: use the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])

    return {
        "tokenizer": tokenizer,
        "chat_template": template,
        "bos_token": bos,
        "eos_token": eos,
        "end_token_ids": end_ids,
        "add_bos_token": _adds_bos(tokenizer, tok_cfg, bos),
    }


def _adds_bos(tokenizer: Tokenizer, tok_cfg: dict, bos: str | None) -> bool:
    if "add_bos_token" in tok_cfg:
        return bool(tok_cfg["add_bos_token"])
    # otherwise the tokenizer.json post-processor decides; ask it
    bos_id = tokenizer.token_to_id(bos) if bos else None
    ids = tokenizer.encode("a", add_special_tokens=True).ids
    return bos_id is not None and bool(ids) and ids[0] == bos_id
