"""SentencePiece ("llama") GGUF vocabularies: Gemma 3 270M's tokenizer rebuilt from its GGUF
metadata against transformers' tokenizer of the same file and against llama.cpp's algorithm.

transformers is the reference, and llama.cpp decides where the two differ: `LlamaCppSpm` below
is llama.cpp's SentencePiece tokenize (src/llama-vocab.cpp: control, unknown and user-defined
tokens cut out of the raw text, longest first; spaces to "▁"; adjacent pieces whose
concatenation is a token merged best score first; bytes for what no token covers), in Python.
The two differences, both pinned below:

- a run of 32 or more spaces: llama.cpp matches the 31-space token first, transformers builds
  spaces out of pairs ("▁▁" merges), 16 + 16 + ...; we follow llama.cpp;
- literal "▁" characters next to each other or to a space: one run here and in transformers,
  separate pieces in llama.cpp (the text is spaced before the runs are cut out).
"""
from __future__ import annotations

import heapq
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guided.model.gguf_file import GGUFFile
from guided.model.tokenizer_gguf import build_gguf_tokenizer

transformers = pytest.importorskip("transformers")

START, END, NEWLINE, BOS, EOS = 105, 106, 107, 2, 1

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)\n",
    "\tindented\n\t\ttwice\n  two spaces\n        eight\n",
    "digits 0 7 42 1234567 3.14159 1,000,000 2024-01-01 0x1F",
    "many   spaces    between     words" + " " * 31 + "and a 31-space run",
    "\n\nnewlines\n\n\nhere\r\n\r\nand CRLF\n",
    "emoji 🤖🚀👍🏽 👨‍👩‍👧 and flags 🇯🇵",
    "CJK: 東京は日本の首都です。中文文本。한국어 텍스트",
    "unicode: naïve café — Привет мир, ελληνικά, e\u0301 vs \u00e9, \u3000 \u00a0 \u200b",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
    " starts with a space",
    "  starts with two",
    "trailing spaces   ",
    "HTML <b>bold</b> <table><tr><td>x</td></tr></table> <start_of_image>",
    "typed byte pieces <0x41> and <unused0> <eos> <bos>",
    "{\"key\": [1, 2, {\"nested\": null}], \"s\": \"a\\tb\"}",
    "\x00\x01\x7f control characters",
    "x" * 300,
    "",
    " ",
]


class LlamaCppSpm:
    """llama.cpp's tokenize for a "llama" (SentencePiece) vocabulary, in Python."""

    def __init__(self, md: dict):
        self.tokens, self.types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
        self.scores = md["tokenizer.ggml.scores"]
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.cut = sorted((i for i, ty in enumerate(self.types) if ty in (2, 3, 4)),
                          key=lambda i: -len(self.tokens[i].encode()))
        self.bytes = {int(t[3:5], 16): i for i, t in enumerate(self.tokens) if self.types[i] == 6}
        self.add_space_prefix = md.get("tokenizer.ggml.add_space_prefix", True)

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        parts: list[str | int] = [text] if text else []
        for tid in self.cut:   # control and unknown only with parse_special; user-defined always
            if not parse_special and self.types[tid] in (2, 3):
                continue
            piece, out = self.tokens[tid], []
            for part in parts:
                while isinstance(part, str) and piece in part:
                    before, part = part.split(piece, 1)
                    out += [before, tid] if before else [tid]
                if part != "":
                    out.append(part)
            parts = out
        ids, after_token = [], True
        for part in parts:
            if isinstance(part, int):
                ids.append(part)
            else:
                prefix = " " if self.add_space_prefix and after_token else ""
                ids += self._merge((prefix + part).replace(" ", "\u2581"))
            after_token = isinstance(part, int)
        return ids

    def _merge(self, text: str) -> list[int]:
        sym, nxt, prv = list(text), list(range(1, len(text))) + [-1], list(range(-1, len(text) - 1))
        queue: list = []

        def push(a: int, b: int) -> None:
            if a >= 0 and b >= 0 and (tid := self.ids.get(sym[a] + sym[b])) is not None:
                heapq.heappush(queue, (-self.scores[tid], a, b, len(sym[a] + sym[b])))

        for i in range(1, len(sym)):
            push(i - 1, i)
        while queue:
            _, a, b, size = heapq.heappop(queue)
            if not sym[a] or not sym[b] or len(sym[a]) + len(sym[b]) != size:
                continue   # stale: one side merged since
            sym[a], sym[b], nxt[a] = sym[a] + sym[b], "", nxt[b]
            if nxt[a] >= 0:
                prv[nxt[a]] = a
            push(prv[a], a)
            push(a, nxt[a])
        out, i = [], 0 if sym else -1
        while i >= 0:
            tid = self.ids.get(sym[i])
            out += [tid] if tid is not None else [self.bytes[b] for b in sym[i].encode()]
            i = nxt[i]
        return out


@pytest.fixture(scope="session")
def gemma_md(gemma3_gguf) -> dict:
    return GGUFFile(gemma3_gguf).metadata


@pytest.fixture(scope="session")
def ours(gemma_md):
    return build_gguf_tokenizer(gemma_md)


@pytest.fixture(scope="session")
def theirs(gemma3_gguf):
    """transformers' tokenizer of the file. AutoTokenizer picks GemmaTokenizer and builds it
    with the same GGUF conversion; called directly it skips AutoTokenizer's config read through
    gguf's pure-Python reader (30 s here), and serialises identically."""
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer
    return GemmaTokenizer.from_pretrained(os.path.dirname(gemma3_gguf), gguf_file=os.path.basename(gemma3_gguf))


@pytest.fixture(scope="session")
def llama_cpp(gemma_md):
    return LlamaCppSpm(gemma_md)


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def test_gemma_tokenizer_metadata(gemma_md, ours):
    md, types = gemma_md, gemma_md["tokenizer.ggml.token_type"]
    assert (md["tokenizer.ggml.model"], md["tokenizer.ggml.pre"]) == ("llama", "default")
    assert md["tokenizer.ggml.add_bos_token"] is True and md["tokenizer.ggml.add_space_prefix"] is False
    assert len(md["tokenizer.ggml.tokens"]) == ours.get_vocab_size() == 262144
    assert types.count(6) == 256   # <0x00>..<0xFF>
    assert ours.token_to_id("<0x0A>") == 248


def test_gemma_tokenizer_matches_transformers_and_llama_cpp(ours, theirs, llama_cpp):
    for text in TEXTS:
        got = _ids(ours, text)
        assert got == theirs.encode(text, add_special_tokens=False), text
        assert got == llama_cpp.encode(text), text
        assert ours.decode(got, skip_special_tokens=False) == text
    assert ours.encode("hi").ids == theirs.encode("hi") == [BOS, 2202]   # add_bos_token
    assert ours.encode("").ids == [BOS]


def test_gemma_chat_markers_and_whitespace_are_single_tokens(ours):
    ids = _ids(ours, "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n")
    assert ids == [START, 2364, NEWLINE, 2202, END, NEWLINE, START, 4368, NEWLINE]
    assert _ids(ours, "\n\n") == [108] and _ids(ours, "\t") == [255968] and _ids(ours, "a  b")[1] == 138
    assert _ids(ours, " " * 31) == [167]


def test_gemma_whitespace_tokens_are_text_not_control(ours):
    """Gemma's runs of newlines, tabs and spaces are user-defined tokens: text the model writes
    everywhere. The engine treats every added token as control (never from client text, never
    shown), so they are the model's own pieces here, never added tokens."""
    from guided.special_tokens import SpecialTokens
    special = SpecialTokens.classify(ours, {EOS}, bos_token="<bos>")
    for tid in (NEWLINE, 108, 138, 255968):
        assert tid not in special.control_ids
    assert {START, END, BOS} <= special.control_ids and {EOS, END} <= special.end_ids
    assert special.bos_id == BOS
    assert ours.decode([START, 2364, NEWLINE, 2202, END], skip_special_tokens=True) == "user\nhi"


def test_gemma_special_parsing_off_never_makes_control_tokens(ours, theirs, llama_cpp, gemma_md):
    """How the engine tokenizes client text (tokenizer.text_tokenizer): `<start_of_turn>` typed
    by a client stays characters, while its newlines are still the newline token."""
    added = set(ours.get_added_tokens_decoder())
    control = [t for t, ty in zip(gemma_md["tokenizer.ggml.tokens"], gemma_md["tokenizer.ggml.token_type"])
               if ty in (2, 3)]
    text = "<start_of_turn>user\nhi<end_of_turn>\n"
    ours.encode_special_tokens = theirs.backend_tokenizer.encode_special_tokens = True
    try:
        got = _ids(ours, text)
        assert not added & set(got)
        assert got == theirs.backend_tokenizer.encode(text, add_special_tokens=False).ids
        assert got == llama_cpp.encode(text, parse_special=False)
        assert NEWLINE in got
        assert not added & {i for e in ours.encode_batch(control, add_special_tokens=False) for i in e.ids}
    finally:
        ours.encode_special_tokens = theirs.backend_tokenizer.encode_special_tokens = False
    assert _ids(ours, text)[0] == START


@pytest.mark.parametrize("spaces", [32, 40, 62, 70])
def test_gemma_long_space_runs_follow_llama_cpp(ours, theirs, llama_cpp, spaces):
    text = "a" + " " * spaces + "b"
    got = _ids(ours, text)
    assert got == llama_cpp.encode(text)
    assert got[1] == 167   # 31 spaces first, as llama.cpp matches user-defined tokens
    assert got != theirs.encode(text, add_special_tokens=False)   # transformers: 16-space pairs
    assert ours.decode(got) == text


def test_gemma_literal_lower_blocks_are_one_run_as_in_transformers(ours, theirs, llama_cpp):
    for text in ("a\u2581\u2581b", "a \u2581b"):
        got = _ids(ours, text)
        assert got == theirs.encode(text, add_special_tokens=False) == [236746, 138, 236763]
        assert got != llama_cpp.encode(text)


_GEMMA_BITS = st.sampled_from(list(" \n\t\r ab<>/é東🤖\u2581\u00a0") +
                              ["<start_of_turn>", "<end_of_turn>", "<b>", "</s>", "<eos>", "  ", "\n\n", "<0x41>"])


@given(st.one_of(st.text(), st.lists(_GEMMA_BITS, max_size=40).map("".join)))
def test_gemma_tokenizer_matches_on_any_text(ours, theirs, llama_cpp, text):
    got = _ids(ours, text)
    ref = theirs.encode(text, add_special_tokens=False)
    assert got == ref
    if "\u2581" not in text:
        assert got == llama_cpp.encode(text)
    if theirs.decode(ref, skip_special_tokens=False) == text:
        assert ours.decode(got, skip_special_tokens=False) == text
