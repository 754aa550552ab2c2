"""The HF `tokenizers` wrapper: special-token registry and incremental detokenizer.

The registry is the one place that knows which added tokens end a message,
open a reasoning block or mark a tool call (DESIGN.md rules 1 and 2). Every
other layer asks it instead of matching token text itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer

# Added tokens that end generation in the families we know, whether or not the
# model's metadata lists them: a model that emits `<|endoftext|>` after an
# answer must stop there too (rule 1: end of sequence is a set).
_KNOWN_END_TEXTS = frozenset({
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>",
    "<|end|>", "<|return|>", "<end_of_turn>", "<｜end▁of▁sentence｜>", "</s>",
})
_REASONING = ("<think>", "</think>")
_TOOL_CALL = ("<tool_call>", "</tool_call>")


@dataclass
class SpecialTokens:
    """Added tokens of one model, classified once at load time."""

    end_ids: frozenset[int]
    bos_id: int | None = None
    reasoning_ids: tuple[int, int] | None = None
    tool_call_ids: tuple[int, int] | None = None
    special_ids: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def classify(cls, tokenizer: Tokenizer, declared_end_ids: set[int],
                 bos_token: str | None = None) -> "SpecialTokens":
        added = {tok.content: tid for tid, tok in tokenizer.get_added_tokens_decoder().items()}
        special = frozenset(tid for tid, tok in tokenizer.get_added_tokens_decoder().items()
                            if tok.special)
        ends = set(declared_end_ids) | {added[t] for t in _KNOWN_END_TEXTS if t in added}
        if not ends:
            raise ValueError("the model declares no end token; generation could never stop")
        return cls(
            end_ids=frozenset(ends),
            bos_id=added.get(bos_token) if bos_token else None,
            reasoning_ids=_pair(added, _REASONING),
            tool_call_ids=_pair(added, _TOOL_CALL),
            special_ids=special,
        )


def _pair(added: dict[str, int], texts: tuple[str, str]) -> tuple[int, int] | None:
    if all(t in added for t in texts):
        return added[texts[0]], added[texts[1]]
    return None


class TokenizerWrapper:
    """Encoding and decoding with the model's own conventions (BOS, specials)."""

    def __init__(self, tokenizer: Tokenizer, special: SpecialTokens, add_bos: bool):
        self.hf = tokenizer
        self.special = special
        self.add_bos = add_bos and special.bos_id is not None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; with parse_special off, `<|im_end|>` stays plain text
        (rule 7). The BOS token is prepended where the model wants one."""
        self.hf.encode_special_tokens = not parse_special
        try:
            ids = self.hf.encode(text, add_special_tokens=False).ids
        finally:
            self.hf.encode_special_tokens = False
        if self.add_bos and (not ids or ids[0] != self.special.bos_id):
            ids = [self.special.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE writes each byte as one printable character:
    printable Latin-1 bytes stand for themselves, the rest are shifted to
    U+0100 and up in byte order. The inverse map: character → byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in keep}
    shifted = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return {c: b for b, c in chars.items()}


_SPECIAL_MARKER = b"\xff"  # llguidance's prefix for special tokens


def token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """The bytes each token id stands for, as llguidance wants them: byte-level
    BPE pieces decoded to raw bytes; special added tokens as b"\\xff" + their
    text (grammars name them, text never produces them); other added tokens
    as their UTF-8 text. Ids with no token get b"" (never allowed)."""
    inverse = _byte_level_alphabet()
    added = tokenizer.get_added_tokens_decoder()
    out = [b""] * tokenizer.get_vocab_size(with_added_tokens=True)
    for piece, tid in tokenizer.get_vocab(with_added_tokens=True).items():
        if tid >= len(out):
            out.extend([b""] * (tid + 1 - len(out)))
        tok = added.get(tid)
        if tok is not None:
            out[tid] = (_SPECIAL_MARKER if tok.special else b"") + tok.content.encode()
        elif all(c in inverse for c in piece):
            out[tid] = bytes(inverse[c] for c in piece)
        else:  # not byte-level (should not happen for our models): take the text
            out[tid] = piece.encode()
    return out


def plain_encoder(tokenizer: Tokenizer):
    """`str -> list[int]`: the canonical tokens of plain text, with no BOS and
    no special-token parsing (a grammar's literal `<|im_end|>` stays text).
    A private copy, so that flipping its settings never races the engine's."""
    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.encode_special_tokens = True
    tok.no_padding()
    tok.no_truncation()
    return lambda text: tok.encode(text, add_special_tokens=False).ids


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Byte-level BPE splits multi-byte characters across tokens; decoding a token
    alone would show U+FFFD. We decode a short window (from `prefix` to the end)
    and emit only what it adds past `read`, holding back while the window ends
    in an incomplete character.
    """

    def __init__(self, tokenizer: TokenizerWrapper, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        window = self.tok.decode(self.ids[self.prefix:], self.skip)
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return ""
        delta = window[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta
