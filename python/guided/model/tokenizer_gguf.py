"""An HF `tokenizers.Tokenizer` rebuilt from a GGUF's vocabulary metadata.

One builder per `tokenizer.ggml.model` (`_MODELS`), each giving the model, normalizer,
pre-tokenizer and decoder; the added tokens and the BOS/EOS post-processor are common.

- "gpt2": byte-level BPE with the file's merges. The way text is split before BPE
  (`tokenizer.ggml.pre`) must be the one the merges were learned with, or multi-character
  runs (digits, whitespace, punctuation) come out as different tokens than the original
  model saw.
- "llama": SentencePiece (Llama 2, Mistral, Gemma), tokenized as llama.cpp does it. Spaces
  become "▁" (after a "▁" prefix where `tokenizer.ggml.add_space_prefix`, llama.cpp's
  default); the file has no merges, so they are derived from the scores: any two adjacent
  pieces whose concatenation is a token may merge, the best-scored first, which is BPE over
  every split of every token ranked by the whole token's score. Characters no token covers
  fall back to the `<0xXX>` byte tokens. Whitespace-only user-defined tokens (Gemma's runs
  of newlines, tabs and spaces) are text: isolated whole before the merges, as llama.cpp
  matches them in the raw text, and never added tokens, which the engine treats as control.
  Two differences from llama.cpp remain: literal "▁" characters next to each other or to a
  space are one run here (spaces become "▁" before runs are cut out; transformers' GGUF
  tokenizer does the same), and with add_space_prefix llama.cpp also prefixes the text after
  such a run (no known vocabulary has both).

Control and unknown tokens, and the other user-defined tokens (`<think>`, Gemma's HTML
tags), are added tokens matched whole and marked special, so that text tokenized with
special parsing off never becomes one.
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# llama.cpp's token types (tokenizer.ggml.token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_SPACE = "\u2581"

# The split rules of the original tokenizer.json files (public model repos).
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# gpt2 pre type → (split regex or None for GPT-2's own, digits one by one, NFC, ignore_merges)
_PRE = {
    "default": (None, False, False, False),
    "gpt-2": (None, False, False, False),
    "gpt2": (None, False, False, False),
    # StarCoder-derived vocabularies (SmolLM, SmolLM2) split every digit apart
    "smollm": (None, True, False, False),
    "starcoder": (None, True, False, False),
    "refact": (None, True, False, False),
    "qwen2": (_QWEN2, False, True, False),
    "deepseek-r1-qwen": (_QWEN2, False, True, False),
    "llama-bpe": (_LLAMA3, False, False, True),
    "llama3": (_LLAMA3, False, False, True),
    "llama-v3": (_LLAMA3, False, False, True),
    "smaug-bpe": (_LLAMA3, False, False, True),
}


def build_gguf_tokenizer(md: dict) -> Tokenizer:
    kind = md.get("tokenizer.ggml.model")
    if kind not in _MODELS:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: {', '.join(sorted(_MODELS))})")
    build, add_bos_default = _MODELS[kind]
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    types: list[int] = md.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    tok, text_ids = build(md, tokens, types)
    _add_special_tokens(tok, [t for i, (t, ty) in enumerate(zip(tokens, types))
                              if ty in (_CONTROL, _USER_DEFINED, _UNKNOWN) and i not in text_ids])
    _set_post_processor(tok, md, tokens, add_bos_default)
    return tok


# -- "gpt2": byte-level BPE ----------------------------------------------------

def _byte_level_bpe(md: dict, tokens: list[str], types: list[int]) -> tuple[Tokenizer, frozenset[int]]:
    pre = md.get("tokenizer.ggml.pre", "default")
    split, digits, nfc, ignore_merges = _PRE.get(pre, _PRE["default"])
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _byte_level_pre_tokenizer(split, digits)
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok, frozenset()


def _byte_level_pre_tokenizer(split: str | None, digits: bool):
    if split is not None:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if digits:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


# -- "llama": SentencePiece ----------------------------------------------------

def _sentencepiece(md: dict, tokens: list[str], types: list[int]) -> tuple[Tokenizer, frozenset[int]]:
    scores: list[float] = md.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    # whitespace-only user-defined tokens, spelled as the text reaches them (" " already "▁")
    spaced = {i: t.replace(" ", _SPACE) for i, (t, ty) in enumerate(zip(tokens, types))
              if ty == _USER_DEFINED and t and not t.strip()}
    pieces = [spaced.get(i, t) for i, t in enumerate(tokens)]
    vocab: dict[str, int] = {}
    for i, p in enumerate(pieces):
        vocab.setdefault(p, i)
    # Merges only ever make normal tokens and the whitespace runs: never a control, byte or
    # marker token, which text with special parsing off must not become.
    mergeable = {i for i, ty in enumerate(types) if ty == _NORMAL and vocab[pieces[i]] == i}
    mergeable |= {i for i in spaced if vocab[pieces[i]] == i}
    known = {pieces[i] for i in mergeable}
    merges = _merges_by_score(pieces, scores, mergeable, known)
    # A run no merges can build (its pieces are not tokens) stays an added token instead.
    memo: dict[str, bool] = {}
    text_ids = frozenset(i for i in spaced if i in mergeable and _buildable(pieces[i], known, memo))

    unk = md.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=tokens[unk] if unk is not None else None,
                               fuse_unk=True, byte_fallback=True))
    steps: list = [normalizers.Replace(" ", _SPACE)]
    add_space_prefix = md.get("tokenizer.ggml.add_space_prefix", True)
    if add_space_prefix:   # per stretch of text between added tokens, as llama.cpp does after each
        steps.insert(0, normalizers.Prepend(_SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    if text_ids:   # leftmost-longest, as llama.cpp matches user-defined tokens
        runs = sorted({pieces[i] for i in text_ids}, key=len, reverse=True)
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("|".join(map(_escape, runs))), behavior="isolated")
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok, text_ids


def _merges_by_score(pieces: list[str], scores: list[float], mergeable: set[int],
                     known: set[str]) -> list[tuple[str, str]]:
    """Every split of every mergeable token into two mergeable tokens (`known`: their pieces),
    the best-scored token first (ties: the lower id, as SentencePiece numbers pieces by frequency)."""
    ranked = sorted((-scores[i], i, k) for i in mergeable for p in (pieces[i],)
                    for k in range(1, len(p)) if p[:k] in known and p[k:] in known)
    return [(pieces[i][:k], pieces[i][k:]) for _, i, k in ranked]


def _buildable(piece: str, known: set[str], memo: dict[str, bool]) -> bool:
    """Whether merges can make `piece` out of its characters."""
    if len(piece) == 1 or piece in memo:
        return len(piece) == 1 or memo[piece]
    memo[piece] = False
    memo[piece] = any(piece[:k] in known and piece[k:] in known and _buildable(piece[:k], known, memo)
                      and _buildable(piece[k:], known, memo) for k in range(1, len(piece)))
    return memo[piece]


def _escape(text: str) -> str:
    return "".join("\\" + c if c in r"\^$.|?*+()[]{}" else c for c in text)


# tokenizer.ggml.model → (builder, add_bos_token where the file does not say: llama.cpp's default)
_MODELS = {
    "gpt2": (_byte_level_bpe, False),
    "llama": (_sentencepiece, True),
}


# -- common ----------------------------------------------------------------------

def _add_special_tokens(tok: Tokenizer, texts: list[str]) -> None:
    # Control and user-defined tokens (<|im_end|>, <think>, <tool_call>) are matched whole. All are
    # marked special so that tokenizing client text with special parsing off (encode_special_tokens)
    # turns them into plain characters; the id each keeps is its vocabulary id.
    if texts:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in texts])


def _set_post_processor(tok: Tokenizer, md: dict, tokens: list[str], add_bos_default: bool) -> None:
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    bos_id, eos_id = md.get("tokenizer.ggml.bos_token_id"), md.get("tokenizer.ggml.eos_token_id")
    add_bos, add_eos = add_bos and bos_id is not None, add_eos and eos_id is not None
    if not (add_bos or add_eos):
        return
    pre = [f"{tokens[bos_id]}:0"] if add_bos else []
    post = [f"{tokens[eos_id]}:0"] if add_eos else []  # pair: [bos] A [eos] [bos] B [eos], as HF llama does
    specials = ([(tokens[bos_id], bos_id)] if add_bos else []) + ([(tokens[eos_id], eos_id)] if add_eos else [])
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join(pre + ["$A:0"] + post),
        pair=" ".join(pre + ["$A:0"] + post + [p.replace(":0", ":1") for p in pre] + ["$B:1"] + post),
        special_tokens=specials)
