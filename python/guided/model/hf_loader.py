"""Loading an HF model directory: config.json, safetensors (single or sharded), tokenizer files."""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from .config import ModelConfig
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
    names = [(h, k) for h in handles for k in h.keys()]
    for handle, name in tqdm(names, desc="loading weights", unit="tensor", leave=False):
        sink.add(name, handle.get_tensor(name))
    model = sink.build()
    model.init_rotary(device, dtype)
    return config, model, raw


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
