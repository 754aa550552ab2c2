"""From a conversation to prompt token ids in which text is never control
(DESIGN.md rule 7).

Every string a client sent (message text, tool descriptions, documents) has
each added token's text replaced by a private-use sentinel character before
the template runs. In the rendered prompt, the added-token texts left are
therefore the template's own markup: they become their token ids; the rest is
plain text, tokenized after the sentinels are turned back into the client's
characters, so a client's `<|im_end|>` stays the characters `<`, `|`, ...
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..special_tokens import SpecialTokens
from ..tokenizer import TokenizerWrapper

# Planes 15 and 16 are private use: no tokenizer text or template uses them.
_SENTINEL_BASES = (0xF0000, 0x100000)


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str                   # the rendered prompt, client text restored
    generation_prompt: str      # what add_generation_prompt added at the end


class ControlEscaper:
    """Swaps added-token texts in client strings for sentinels and back."""

    def __init__(self, special: SpecialTokens, strings: list[str]):
        texts = sorted(set(special.texts.values()), key=len, reverse=True)
        used = {ord(c) for s in strings for c in s}
        base = next((b for b in _SENTINEL_BASES
                     if not any(b <= c < b + len(texts) for c in used)), None)
        if base is None:  # both private planes used by the client's own text: escape nothing
            texts = []
            base = _SENTINEL_BASES[0]
        self.to_sentinel = {t: chr(base + i) for i, t in enumerate(texts)}
        self.from_sentinel = {v: k for k, v in self.to_sentinel.items()}
        self._find = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._back = re.compile("|".join(map(re.escape, self.from_sentinel))) if texts else None

    def escape(self, value: Any) -> Any:
        """``value`` with every string in it escaped (dicts, lists, tuples)."""
        if isinstance(value, str):
            return self._find.sub(lambda m: self.to_sentinel[m.group(0)], value) \
                if self._find else value
        if isinstance(value, dict):
            return {self.escape(k): self.escape(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.escape(v) for v in value]
        return value

    def unescape(self, text: str) -> str:
        return self._back.sub(lambda m: self.from_sentinel[m.group(0)], text) if self._back else text


def strings_in(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in strings_in(v)] + \
            [k for k in value if isinstance(k, str)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in strings_in(v)]
    return []


def tokenize_rendered(text: str, special: SpecialTokens, tokenizer: TokenizerWrapper,
                      escaper: ControlEscaper) -> list[int]:
    """Token ids of a rendered prompt: added-token texts (the template's) as
    their ids, everything between as plain text with the client's characters
    restored."""
    ids: list[int] = []
    by_text = {t: i for i, t in sorted(special.texts.items(), reverse=True)}
    pattern = re.compile("|".join(map(re.escape, sorted(by_text, key=len, reverse=True))))
    pos = 0
    for m in pattern.finditer(text):
        if m.start() > pos:
            ids += tokenizer.encode_text(escaper.unescape(text[pos:m.start()]))
        ids.append(by_text[m.group(0)])
        pos = m.end()
    if pos < len(text):
        ids += tokenizer.encode_text(escaper.unescape(text[pos:]))
    return ids
