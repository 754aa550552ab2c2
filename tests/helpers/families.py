"""Test models for each chat family: the default model's real weights with
its tokenizer's 14 unused added tokens (ids 3-16: `<repo_name>`, ...)
renamed to the family's markers and the family's own template from
../shared/chat-templates (or, where ../shared has none, one written in
tests/helpers/templates.py: gpt-oss's harmony). `family_path` gives the
default GGUF copied with that tokenizer and template (its Q4_1 blocks as they
are: the native CPU step, as a user serving a GGUF gets); `build` the
tokenizer files and template as an HF directory beside given weights
(helpers/family_model.py builds other architectures on it).

No model here was trained on these formats; what the tests check is what the
engine guarantees by construction (grammar, parser, registry, round-trip).
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from . import SHARED
from .templates import WRITTEN

TEMPLATES = SHARED / "chat-templates"
FIRST_FREE_ID, LAST_FREE_ID = 3, 16   # SmolLM2's unused added tokens

_CHATML_TOOLS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
_DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
             "<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
             "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
             "<｜tool▁outputs▁begin｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")
_MISTRAL = ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]")


@dataclass(frozen=True)
class Family:
    name: str
    template: str | None          # file in ../shared/chat-templates or a WRITTEN key; None: the GGUF's own
    markers: tuple[str, ...]      # texts given to ids 3, 4, ...
    tool_format: str              # what detection must find
    bos: str | None = None
    eos: str = "<|im_end|>"
    reasoning: bool = False
    strips_reasoning: bool = False  # the template drops past reasoning (cache ratio only measured)
    #: why the template itself renders a past turn unlike the prompt that
    #: produced it (the cache ratio is then measured, not asserted)
    rerenders_differently: str | None = None
    #: the template writes the system prompt into the last user turn only, so
    #: a conversation with one cannot keep its cache past that turn
    moves_system_prompt: bool = False
    generation_prompt: str = "<|im_start|>assistant\n"
    #: the reasoning block the generation prompt leaves: "open", "closed" or None
    reasoning_state: str | None = None


FAMILIES = [
    Family("smollm2", None, (), "text_envelope"),
    Family("qwen2.5", "Qwen-Qwen2.5-7B-Instruct.jinja", _CHATML_TOOLS, "hermes"),
    Family("hermes3", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
           _CHATML_TOOLS + ("<|begin_of_text|>",), "hermes", bos="<|begin_of_text|>",
           rerenders_differently="the last tool message is closed without the newline a middle "
                                 "one gets"),
    Family("qwen3", "Qwen-Qwen3-0.6B.jinja", _CHATML_TOOLS + ("<think>", "</think>"), "hermes",
           reasoning=True),
    Family("qwen3-coder", "Qwen3-Coder.jinja", _CHATML_TOOLS, "qwen3_coder"),
    Family("llama3.1", "meta-llama-Llama-3.1-8B-Instruct.jinja",
           ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|eom_id|>", "<|python_tag|>"), "llama3_json", bos="<|begin_of_text|>", eos="<|eot_id|>",
           generation_prompt="<|start_header_id|>assistant<|end_header_id|>\n\n"),
    Family("mistral-nemo", "mistralai-Mistral-Nemo-Instruct-2407.jinja", _MISTRAL, "mistral_list",
           bos="<s>", eos="</s>", generation_prompt="", moves_system_prompt=True),
    Family("devstral", "unsloth-mistral-Devstral-Small-2507.jinja",
           _MISTRAL + ("[ARGS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[CALL_ID]"), "mistral_args",
           bos="<s>", eos="</s>", generation_prompt=""),
    Family("nemotron-super", "nvidia-Llama-3_3-Nemotron-Super-49B-v1_5.jinja",
           ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<think>", "</think>", "<TOOLCALL>", "</TOOLCALL>"), "nemotron", bos="<|begin_of_text|>",
           eos="<|eot_id|>", reasoning=True, strips_reasoning=True,
           generation_prompt="<|start_header_id|>assistant<|end_header_id|>\n\n"),
    Family("nemotron-nano", "NVIDIA-Nemotron-Nano-v2.jinja",
           ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<think>", "</think>", "<TOOLCALL>",
            "</TOOLCALL>"), "nemotron", eos="<SPECIAL_12>", reasoning=True, strips_reasoning=True,
           generation_prompt="<SPECIAL_11>Assistant\n<think>\n\n", reasoning_state="open",
           rerenders_differently="past turns lose the reasoning block of the generation prompt"),
    Family("lfm2", "llama-cpp-lfm2.jinja",
           ("<|tool_call_start|>", "<|tool_call_end|>", "<|tool_list_start|>", "<|tool_list_end|>",
            "<|tool_response_start|>", "<|tool_response_end|>", "<|startoftext|>"), "lfm2",
           bos="<|startoftext|>"),
    Family("granite", "vllm-tool_chat_template_granite.jinja",
           ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>"), "granite",
           eos="<|end_of_text|>", generation_prompt="<|start_of_role|>assistant<|end_of_role|>"),
    Family("phi4-mini", "llama-cpp-microsoft-Phi-4-mini-instruct.jinja",
           ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>",
            "<|tool_call|>", "<|/tool_call|>", "<|tool_response|>"), "phi4_mini", eos="<|end|>",
           generation_prompt="<|assistant|>"),
    Family("minimax-m1", "vllm-tool_chat_template_minimax_m1.jinja",
           ("<beginning_of_sentence>", "<end_of_sentence>", "<begin_of_document>"), "minimax_m1",
           eos="<end_of_sentence>", generation_prompt="<beginning_of_sentence>ai name=MiniMax AI\n"),
    Family("glm-4.6", "GLM-4.6.jinja",
           ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
            "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
            "</arg_value>"), "glm4.6", eos="<|user|>", reasoning=True, strips_reasoning=True,
           generation_prompt="<|assistant|>"),
    Family("minimax-m2", "unsloth-MiniMax-M2.jinja",
           ("]~!b[", "]~b]", "[e~[", "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"),
           "minimax_m2", eos="[e~[", reasoning=True, strips_reasoning=True,
           generation_prompt="]~b]ai\n<think>\n", reasoning_state="open",
           rerenders_differently="past turns lose the reasoning block of the generation prompt"),
    Family("kimi-k2", "moonshotai-Kimi-K2-Thinking.jinja",
           ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<think>", "</think>",
            "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>", "<|tool_call_end|>"), "kimi_k2", reasoning=True,
           strips_reasoning=True, generation_prompt="<|im_assistant|>assistant<|im_middle|>"),
    Family("lfm2.5", "LFM2.5-8B-A1B.jinja",
           ("<|startoftext|>", "<|tool_call_start|>", "<|tool_call_end|>", "<think>", "</think>"),
           "pythonic_lfm", bos="<|startoftext|>", reasoning=True, strips_reasoning=True),
    Family("deepseek-r1", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", _DEEPSEEK, "deepseek_r1",
           bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", reasoning=True,
           strips_reasoning=True, generation_prompt="<｜Assistant｜><think>\n</think>", reasoning_state="closed",
           rerenders_differently="past turns lose the reasoning block of the generation prompt"),
    Family("deepseek-v3.1", "deepseek-ai-DeepSeek-V3.1.jinja", _DEEPSEEK, "deepseek_v3",
           bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", reasoning=True,
           strips_reasoning=True, generation_prompt="<｜Assistant｜><think></think>", reasoning_state="closed",
           rerenders_differently="past turns lose the reasoning block of the generation prompt"),
]
FAMILIES.append(
    Family("gpt-oss", "written: harmony (gpt-oss)",
           ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"),
           "harmony", eos="<|return|>", reasoning=True, strips_reasoning=True, generation_prompt="<|start|>assistant",
           rerenders_differently="a past final answer ends <|end|> where the model ended it <|return|>"))
BY_NAME = {f.name: f for f in FAMILIES}


def template_text(family: Family) -> str:
    """The family's template from ../shared; the test skips, naming it, where a clone has none."""
    if family.template in WRITTEN:
        return WRITTEN[family.template]
    path = TEMPLATES / family.template
    if not path.exists():
        pytest.skip(f"{path} is absent (the shared chat templates are beside the clone)")
    return path.read_text(encoding="utf-8")


def family_path(name: str, root: Path, gguf_path: str) -> str:
    """The test model of family ``name``: the default GGUF itself, or its copy
    with the family's tokenizer and template, written under ``root`` on first use."""
    family = BY_NAME[name]
    if family.template is None:
        return gguf_path
    return build_gguf(family, gguf_path, root)


@functools.cache
def _reader(gguf_path: str):
    """The default GGUF parsed once (2.5 s of gguf-py's field parsing), for every family's copy."""
    from gguf import GGUFReader
    return GGUFReader(gguf_path)


def build_gguf(family: Family, gguf_path: str, root: Path) -> str:
    """``root``/<family>.gguf: the default GGUF's tensors and metadata (gguf's own
    copy_with_new_metadata) with the family's markers, end and begin tokens and template."""
    from gguf import GGUFValueType, GGUFWriter, Keys
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
    path = root / f"{family.name}.gguf"
    if path.exists():
        return str(path)
    reader = _reader(gguf_path)
    tokens = list(reader.fields[Keys.Tokenizer.LIST].contents())
    for i, marker in enumerate(family.markers):
        tokens[FIRST_FREE_ID + i] = marker
    ids = token_ids(family)
    new = {Keys.Tokenizer.LIST: MetadataDetails(GGUFValueType.ARRAY, tokens, sub_type=GGUFValueType.STRING),
           Keys.Tokenizer.CHAT_TEMPLATE: MetadataDetails(GGUFValueType.STRING, template_text(family)),
           Keys.Tokenizer.EOS_ID: MetadataDetails(GGUFValueType.UINT32, ids[family.eos])}
    drop = [Keys.Tokenizer.PAD_ID]   # the default's pad is its own end token
    if family.bos is None:
        drop.append(Keys.Tokenizer.BOS_ID)
    else:
        new[Keys.Tokenizer.BOS_ID] = MetadataDetails(GGUFValueType.UINT32, ids[family.bos])
    partial = path.with_suffix(".partial")
    writer = GGUFWriter(str(partial), reader.fields[Keys.General.ARCHITECTURE].contents(), endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, new, drop)
    partial.rename(path)
    return str(path)


@functools.cache
def _default_tokenizer(gguf_path: str) -> tuple[dict, str]:
    """The default GGUF's metadata and its tokenizer as tokenizer.json text, read once
    (0.5 s a family otherwise)."""
    from guided.model.gguf_file import GGUFFile
    from guided.model.gguf_loader import gguf_tokenizer_info
    md = GGUFFile(gguf_path).metadata
    return md, gguf_tokenizer_info(md)["tokenizer"].to_str()


def build(family: Family, gguf_path: str, root: Path, weights: Path) -> str:
    """The family's HF directory under ``root`` (weights shared by symlink)."""
    d = root / family.name
    if (d / "config.json").exists():
        return str(d)
    md, tokenizer = _default_tokenizer(gguf_path)
    d.mkdir(parents=True)
    (d / "tokenizer.json").write_text(_renamed(tokenizer, family.markers), encoding="utf-8")
    ids = token_ids(family)
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": family.bos, "eos_token": family.eos, "add_bos_token": False,
        "chat_template": template_text(family)}), encoding="utf-8")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids[family.eos]]}))
    (d / "config.json").write_text(json.dumps(hf_config(md, ids[family.eos])))
    os.symlink(weights, d / "model.safetensors")
    return str(d)


def token_ids(family: Family) -> dict[str, int]:
    """The ids of the family's markers, and of the default model's own ChatML tokens."""
    ids = {m: FIRST_FREE_ID + i for i, m in enumerate(family.markers)}
    ids.update({"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2})
    return ids


def _renamed(tokenizer_json: str, markers: tuple[str, ...]) -> str:
    if len(markers) > LAST_FREE_ID - FIRST_FREE_ID + 1:
        raise ValueError("more markers than unused tokens")
    spec = json.loads(tokenizer_json)
    renames = {FIRST_FREE_ID + i: m for i, m in enumerate(markers)}
    old = {}
    for added in spec["added_tokens"]:
        if added["id"] in renames:
            old[added["content"]] = renames[added["id"]]
            added["content"] = renames[added["id"]]
    vocab = spec["model"]["vocab"]
    spec["model"]["vocab"] = {old.get(k, k): v for k, v in vocab.items()}
    return json.dumps(spec, ensure_ascii=False)


def hf_config(md: dict, eos_id: int) -> dict:
    from guided.model.config import ModelConfig
    c = ModelConfig.from_gguf(md)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings,
            "tie_word_embeddings": c.tie_word_embeddings, "eos_token_id": eos_id}
