"""The HF `tokenizers` wrapper: text that never becomes control tokens, the
bytes llguidance sees per token, and the incremental detokenizer. What each
added token is for is the registry's business (special_tokens.py)."""
from __future__ import annotations

import copy
import itertools

from tokenizers import AddedToken, Tokenizer

from .special_tokens import SpecialTokens

__all__ = ["SpecialTokens", "TokenizerWrapper", "IncrementalDetokenizer", "token_bytes",
           "plain_encoder", "text_tokenizer", "twin"]


def text_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """A twin of ``tokenizer`` that turns text into text tokens only.

    Every added token is special in it and special parsing is off, so
    `<|im_end|>` or `<tool_call>` written in text becomes ordinary
    characters, whether the tokenizer marked the token special or not (HF
    Qwen tokenizers, for one, leave `<tool_call>` non-special). Its settings
    are its own, so flipping them never races the engine's tokenizer.
    """
    tok = twin(tokenizer, all_special=True)
    tok.encode_special_tokens = True
    return tok


def twin(tokenizer: Tokenizer, *, all_special: bool = False) -> Tokenizer:
    """A new tokenizer over ``tokenizer``'s model, normalizer, pre-tokenizer,
    post-processor and decoder, shared (encoding only reads them: no copy of
    a 152k vocabulary, which took 0.5 s), with its added tokens at their ids
    (every one special where ``all_special``). Added tokens, padding,
    truncation and special parsing are the twin's own: changing them leaves
    ``tokenizer`` as it was."""
    tok = Tokenizer(tokenizer.model)
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        if (value := getattr(tokenizer, part)) is not None:
            setattr(tok, part, value)
    # Added in id order they get their ids back: those in the model's vocabulary its
    # ids, the others the next ids past the model's, in order, as they had them.
    added = sorted(tokenizer.get_added_tokens_decoder().items())
    for special, run in itertools.groupby((t for _, t in added), lambda t: all_special or t.special):
        if special:
            tok.add_special_tokens([AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip,
                                               rstrip=t.rstrip, normalized=t.normalized, special=True)
                                    for t in run])
        else:
            tok.add_tokens(list(run))
    if {i: t.content for i, t in tok.get_added_tokens_decoder().items()} != {i: t.content for i, t in added}:
        raise ValueError("the tokenizer's added tokens did not keep their ids in its twin")
    return tok


class TokenizerWrapper:
    """Encoding and decoding with the model's own conventions (BOS, specials)."""

    def __init__(self, tokenizer: Tokenizer, special: SpecialTokens, add_bos: bool):
        self.hf = tokenizer
        self.special = special
        self.add_bos = add_bos and special.bos_id is not None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._text = text_tokenizer(tokenizer)

    def with_special(self, special: SpecialTokens) -> TokenizerWrapper:
        """This wrapper under another registry of the same vocabulary (one that knows a
        template's end-of-turn token), sharing the tokenizer and its text copy."""
        other = copy.copy(self)
        other.special = special
        return other

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; with parse_special off no added token can come
        out of it (rule 7). The BOS token is prepended where the model wants one."""
        ids = self.encode_text(text) if not parse_special else \
            self.hf.encode(text, add_special_tokens=False).ids
        if self.add_bos and (not ids or ids[0] != self.special.bos_id):
            ids = [self.special.bos_id] + ids
        return ids

    def encode_text(self, text: str) -> list[int]:
        """Plain text → token ids: no BOS, never an added token."""
        return self._text.encode(text, add_special_tokens=False).ids

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
    BPE pieces decoded to raw bytes, SentencePiece pieces with "▁" as a space
    and <0xAB> as that byte; special added tokens as b"\\xff" + their text
    (grammars name them by id, text never produces them: rule 7), other added
    tokens (Gemma's runs of newlines) as their text. Ids with no token get b""
    (never allowed)."""
    piece_bytes = _sentencepiece_bytes if getattr(tokenizer.model, "byte_fallback", False) \
        else _byte_level_bytes(_byte_level_alphabet())
    added = tokenizer.get_added_tokens_decoder()
    out = [b""] * tokenizer.get_vocab_size(with_added_tokens=True)
    for piece, tid in tokenizer.get_vocab(with_added_tokens=True).items():
        if tid >= len(out):
            out.extend([b""] * (tid + 1 - len(out)))
        tok = added.get(tid)
        if tok is not None:
            out[tid] = (_SPECIAL_MARKER if tok.special else b"") + tok.content.encode()
        else:
            out[tid] = piece_bytes(piece)
    return out


def _byte_level_bytes(inverse: dict[str, int]):
    """A piece's bytes, one C-level translate a piece (a 152k vocabulary in
    tens of milliseconds): each alphabet character becomes the Latin-1
    character of its byte and every other character one Latin-1 cannot
    encode, so that a piece not wholly byte-level (should not happen for our
    models) is taken as its text."""
    table = {ord(c): b for c, b in inverse.items()}
    table.update({o: 0xFFFF for o in range(256) if o not in table})

    def piece_bytes(piece: str) -> bytes:
        try:
            return piece.translate(table).encode("latin-1")
        except UnicodeEncodeError:
            return piece.encode()
    return piece_bytes


def _sentencepiece_bytes(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode()


def plain_encoder(tokenizer: Tokenizer):
    """`str -> list[int]`: the canonical tokens of plain text, with no BOS and
    no added token (a grammar's literal `<|im_end|>` stays text)."""
    tok = text_tokenizer(tokenizer)
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
