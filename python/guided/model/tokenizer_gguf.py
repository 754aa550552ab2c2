"""An HF `tokenizers.Tokenizer` rebuilt from a GGUF's vocabulary metadata.

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported. The way text
is split before BPE (`tokenizer.ggml.pre`) must be the one the merges were
learned with, or multi-character runs (digits, whitespace, punctuation) come
out as different tokens than the original model saw.
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# The split rules of the original tokenizer.json files (public model repos).
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# pre type → (split regex or None for GPT-2's own, digits one by one, NFC, ignore_merges)
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

_CONTROL, _USER_DEFINED, _UNKNOWN = 3, 4, 2


def build_gguf_tokenizer(md: dict) -> Tokenizer:
    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE, 'gpt2', is supported)")
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    pre = md.get("tokenizer.ggml.pre", "default")
    split, digits, nfc, ignore_merges = _PRE.get(pre, _PRE["default"])

    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(split, digits)
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    _add_special_tokens(tok, tokens, md.get("tokenizer.ggml.token_type") or [])
    _set_post_processor(tok, md, tokens)
    return tok


def _pre_tokenizer(split: str | None, digits: bool):
    if split is not None:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if digits:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _add_special_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    # Control and user-defined tokens (<|im_end|>, <think>, <tool_call>) are matched whole. All are
    # marked special so that tokenizing client text with special parsing off (encode_special_tokens)
    # turns them into plain characters; the id each keeps is its vocabulary id.
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED, _UNKNOWN)]
    if special:
        tok.add_special_tokens(special)


def _set_post_processor(tok: Tokenizer, md: dict, tokens: list[str]) -> None:
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False))
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
