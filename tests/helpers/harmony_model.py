"""A tiny random gpt-oss that speaks harmony, as one GGUF: transformers'
GptOssForCausalLM at the sizes of tiny_models' "gpt_oss" row, but over the
default model's byte-level vocabulary (the tiny WordLevel one cannot write
JSON), with the gpt-oss family's markers, end token and template
(families.py), written by gguf_writer as llama.cpp's converter would.

Weights, template and tool format then all come from the file, as they do
from a published gpt-oss GGUF; nothing here was trained on harmony.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import transformers

from .families import BY_NAME, FIRST_FREE_ID, build
from .gguf_writer import write_gguf
from .tiny_models import ARCHITECTURES, randomise

#: positions enough for a four-turn agent loop (the tiny row has 512: YaRN's 16 x 32)
CONTEXT = 2048


def harmony_gguf(default_gguf: str, root: Path, qtype: str = "Q8_0") -> str:
    """Write ``root``/gpt-oss.gguf (and the HF directories it is made from).
    Q8_0 by default: a GGUF kept in its blocks runs the engine's native CPU
    step, as a published one does."""
    from guided.model.config import ModelConfig
    from guided.model.gguf_file import GGUFFile
    family = BY_NAME["gpt-oss"]
    config = ARCHITECTURES["gpt_oss"]()
    config.vocab_size = ModelConfig.from_gguf(GGUFFile(default_gguf).metadata).vocab_size
    config.eos_token_id = FIRST_FREE_ID + family.markers.index(family.eos)
    config.max_position_embeddings = CONTEXT
    config.rope_parameters["factor"] = CONTEXT / config.rope_parameters["original_max_position_embeddings"]
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomise(model)    # seeds torch itself
    weights = root / "weights"
    model.save_pretrained(weights)
    # the family's tokenizer files, then gpt-oss's config over the Llama one build writes
    directory = Path(build(family, default_gguf, root, weights / "model.safetensors"))
    shutil.copyfile(weights / "config.json", directory / "config.json")
    return write_gguf(directory, root / "gpt-oss.gguf", qtype)
