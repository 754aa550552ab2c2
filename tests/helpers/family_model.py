"""A chat family's own architecture as one GGUF (or an HF directory): a tiny
random transformers model of the architecture the family's template was
written for (gpt-oss for harmony, LFM2 for Liquid's tool calls, Granite 4.0-H
for Granite's), at the sizes of its tiny_models row
but over the default model's byte-level vocabulary (the tiny WordLevel one
cannot write JSON), with the family's markers, end token and template
(families.py), written by gguf_writer as llama.cpp's converter would.

Weights, template and tool format then all come from the file, as they do
from a published GGUF; nothing here was trained on the family's format.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import transformers

from .families import BY_NAME, build, token_ids
from .gguf_writer import write_gguf
from .tiny_models import ARCHITECTURES, randomise

#: positions enough for a four-turn agent loop (the tiny rows have 512)
CONTEXT = 2048
#: family → its architecture's tiny_models row
ARCHITECTURE = {"gpt-oss": "gpt_oss", "lfm2": "lfm2", "granite": "granitemoehybrid_mamba", "qwen3": "qwen3_5",
                "nemotron-nano": "nemotron_h",
                # Falcon-H1 (attention and Mamba-2 side by side) under a ChatML template with Hermes calls
                "qwen2.5": "falcon_h1"}


def family_gguf(family_name: str, default_gguf: str, root: Path, qtype: str = "Q8_0") -> str:
    """Write ``root``/<family>.gguf (and the HF directories it is made from).
    Q8_0 by default: a GGUF kept in its blocks runs the engine's native CPU
    step, as a published one does."""
    return write_gguf(family_directory(family_name, default_gguf, root), root / f"{family_name}.gguf", qtype)


def family_directory(family_name: str, default_gguf: str, root: Path) -> Path:
    """The model as an HF directory under ``root`` (its architecture's config and weights, the
    family's tokenizer files and template)."""
    from guided.model.config import ModelConfig
    from guided.model.gguf_file import GGUFFile
    family = BY_NAME[family_name]
    config = ARCHITECTURES[ARCHITECTURE[family_name]]()
    config.vocab_size = ModelConfig.from_gguf(GGUFFile(default_gguf).metadata).vocab_size
    config.eos_token_id = token_ids(family)[family.eos]
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "yarn":   # gpt-oss's YaRN stretched over the longer context
        rope["factor"] = CONTEXT / rope["original_max_position_embeddings"]
    config.max_position_embeddings = CONTEXT
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomise(model)    # seeds torch itself
    weights = root / "weights"
    model.save_pretrained(weights)
    # the family's tokenizer files, then the architecture's config over the Llama one build writes
    directory = Path(build(family, default_gguf, root, weights / "model.safetensors"))
    shutil.copyfile(weights / "config.json", directory / "config.json")
    return directory
