"""Loading a .gguf file: config from metadata, dequantised weights, tokenizer, template."""
from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from .config import ModelConfig
from .gguf_file import GGUFFile
from .tokenizer_gguf import build_gguf_tokenizer
from .weights import WeightSink

_TOP = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
# llama.cpp's converter interleaves the rotary halves of Q/K rows for these architectures
_PERMUTED_QK = ("llama",)


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] != "blk" or parts[2] not in _BLOCK:
        return None
    return f"layers.{parts[1]}.{_BLOCK[parts[2]]}.{parts[3]}"


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head (2, d/2) → (d/2, 2) row interleave, back to the HF half-split layout."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_gguf(path: str, dtype: torch.dtype, device: torch.device):
    gguf = GGUFFile(path)
    md = gguf.metadata
    config = ModelConfig.from_gguf(md)
    sink = WeightSink(config, dtype, device)
    freq_factors = None
    for info in tqdm(gguf.tensors, desc="loading weights", unit="tensor", leave=False):
        if info.name == "rope_freqs.weight":
            freq_factors = torch.from_numpy(np.array(gguf.read(info), dtype=np.float32))
            continue
        name = hf_name(info.name)
        if name is None:
            continue
        w = torch.from_numpy(np.array(gguf.read(info), dtype=np.float32))
        if config.architecture in _PERMUTED_QK and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute(w, config.num_heads)
        elif config.architecture in _PERMUTED_QK and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute(w, config.num_kv_heads)
        sink.add(name, w)
    model = sink.build()
    model.init_rotary(device, dtype, freq_factors)
    return config, model, md


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
