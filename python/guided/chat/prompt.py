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

import hashlib
import re
import threading
from array import array
from collections import OrderedDict
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
        """``value`` with every string in it escaped (dicts, lists, tuples),
        of its own type where that is a subclass: tool-call arguments print
        as the JSON the model wrote (chat_format.TemplateArguments), not as
        Python's repr of a dict (rule 6)."""
        if isinstance(value, str):
            return self._find.sub(lambda m: self.to_sentinel[m.group(0)], value) \
                if self._find else value
        if isinstance(value, dict):
            escaped = {self.escape(k): self.escape(v) for k, v in value.items()}
            return escaped if type(value) is dict else type(value)(escaped)
        if isinstance(value, (list, tuple)):
            items = [self.escape(v) for v in value]
            return items if type(value) in (list, tuple) else type(value)(items)
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


class CompletionMemo:
    """The tokens the model wrote for each run of text between control tokens
    in its recent answers (rule 6), keyed by every token before the run.

    A model under a grammar, or simply sampling, may write a text in tokens
    other than the tokenizer's own split of it, and the generation prompt's
    last characters may merge with the answer's first when the whole is
    tokenized again. Either would make the next turn's prompt leave the
    prefix cache where the answer starts. When a client sends an answer
    back, its text runs are tokenized as the model wrote them: the same text,
    the same tokens, the cache hit up to the new turn.

    A run is kept under (a digest of every token before it: the prompt's and
    the answer's before it, the run's text), and a prompt's piece of text
    takes it only under the same key: only where everything before it came
    back token for token, which is exactly where the prefix cache can use
    it. No other conversation (another user's model may have written the
    same text in other tokens), and no other place in the prompt (the same
    text ending a system prompt's paragraph), is touched. An answer's first
    run comes back in one piece with the text its prompt ended with
    ("assistant\n" + the answer; Qwen3.5's "\n" after <think> + the "\n"
    the model writes before </think>): it is kept after the prompt's last
    control token, as that text and the run, in the prompt's tokens and the
    model's. A run the model wrote in the tokenizer's own split is not kept:
    the tokenizer gives it back. The most recently used runs are kept.
    """

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        #: (digest of the tokens before a run, its text) → the tokens the model wrote it in
        self._runs: OrderedDict[tuple[bytes, str], list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, prompt: list[int], answer: list[int], special: SpecialTokens,
                 tokenizer: TokenizerWrapper) -> None:
        """Keep the runs of ``answer``, the tokens the model wrote after
        ``prompt`` (as the template renders them back: parser.py)."""
        controls = special.control_ids
        k = len(prompt)
        while k and prompt[k - 1] not in controls:
            k -= 1
        before = _TokenDigest()
        before.extend(prompt[:k])
        run, start = prompt[k:], len(prompt) - k   # the prompt's tail begins the first run
        for t in [*answer, None]:
            if t is not None and t not in controls:
                run.append(t)
                continue
            if run:
                self._put(before.key(), run, tokenizer)
                # the answer's last run, less the whitespace a model may
                # write after its last call (the grammar's _trailing), which
                # no template writes back
                bare = len(run)
                while bare > start and not tokenizer.decode(run[bare - 1:bare]).strip():
                    bare -= 1
                if (t is None or t in special.end_ids) and 0 < bare < len(run):
                    self._put(before.key(), run[:bare], tokenizer)
                before.extend(run)
            if t is not None:
                before.extend([t])
            run, start = [], 0

    def _put(self, key: bytes, run: list[int], tokenizer: TokenizerWrapper) -> None:
        text = tokenizer.decode(run, skip_special_tokens=False)
        if "\ufffd" in text:
            return   # cut inside a character
        own = tokenizer.encode_text(text) == run
        with self._lock:
            if own:   # the tokenizer gives it back: only forget what an earlier answer wrote there
                self._runs.pop((key, text), None)
                return
            self._runs[key, text] = list(run)
            self._runs.move_to_end((key, text))
            while len(self._runs) > self.capacity:
                self._runs.popitem(last=False)

    def get(self, key: bytes, piece: str) -> list[int] | None:
        """The tokens the model wrote ``piece`` in after the tokens whose
        digest is ``key``, if it did."""
        with self._lock:
            ids = self._runs.get((key, piece))
            if ids is not None:
                self._runs.move_to_end((key, piece))
            return ids


class _TokenDigest:
    """A digest of a token sequence, extended as it grows (never rehashed
    whole): the memo's key for what comes after it."""

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=16)

    def extend(self, ids: list[int]) -> None:
        self._hash.update(array("I", ids).tobytes())

    def key(self) -> bytes:
        return self._hash.digest()


def tokenize_rendered(text: str, special: SpecialTokens, tokenizer: TokenizerWrapper,
                      escaper: ControlEscaper, memo: CompletionMemo | None = None) -> list[int]:
    """Token ids of a rendered prompt: added-token texts (the template's) as
    their ids, everything between as plain text with the client's characters
    restored (and the model's own tokens for text it wrote, from ``memo``,
    where everything before that text is as the model's answer had it)."""
    by_text = {t: i for i, t in sorted(special.texts.items(), reverse=True)}
    pattern = re.compile("|".join(map(re.escape, sorted(by_text, key=len, reverse=True))))
    parts: list[str | int] = []   # plain pieces and control token ids, in order
    pos = 0
    for m in pattern.finditer(text):
        if m.start() > pos:
            parts.append(escaper.unescape(text[pos:m.start()]))
        parts.append(by_text[m.group(0)])
        pos = m.end()
    if pos < len(text):
        parts.append(escaper.unescape(text[pos:]))
    ids: list[int] = []
    before = _TokenDigest()   # of every id so far
    for part in parts:
        if isinstance(part, int):
            new = [part]
        else:
            written = memo.get(before.key(), part) if memo is not None else None
            new = list(written) if written is not None else tokenizer.encode_text(part)
        ids += new
        before.extend(new)
    return ids


def rendered_back(ids: list[int], block: list[int], block_prefix: str, runs: list[int | str],
                  special: SpecialTokens, tokenizer: TokenizerWrapper, block_ends: frozenset[int]) -> list[int]:
    """An answer's tokens ``ids`` with its calls block (its last tokens,
    ``block``, and ``block_prefix``, the block's text that tokens before it
    hold: a text trigger) as the template renders it back (``runs``: its
    marker tokens and texts, tool_formats.ToolFormat.rendered_runs): each
    text in the model's tokens where the model wrote that text, in the
    tokenizer's elsewhere. Remembered so (CompletionMemo: each run under
    the tokens before it), the runs after the call are kept where the next
    prompt holds them, after the call as the template renders it: the turns
    after this one come back whole, though the model wrote the call in a
    spelling of its own (gpt-oss's other spellings)."""
    controls = special.control_ids
    before = ids[:len(ids) - len(block)]
    k = len(before)
    while k and before[k - 1] not in controls:
        k -= 1
    # the text run the block begins in: its text before the block, and in the block
    head, written_runs = before[k:], _runs(block, controls)
    head_text = tokenizer.decode(head) if head else ""
    if not head_text.endswith(block_prefix):
        return ids
    lead = head_text[:len(head_text) - len(block_prefix)]
    first = written_runs.pop(0) if block and block[0] not in controls else []
    written: dict[str, list[list[int]]] = {}
    for run in written_runs:
        written.setdefault(tokenizer.decode(run), []).append(run)
    items = list(runs)
    text = lead + (items.pop(0) if items and isinstance(items[0], str) else "")
    out = before[:k]
    if text == head_text + (tokenizer.decode(first) if first else ""):
        out += head + first
    elif not block_prefix:   # the block began with a marker token: the run before it is the model's
        out += head + (tokenizer.encode_text(text[len(lead):]) if len(text) > len(lead) else [])
    else:
        out += tokenizer.encode_text(text)
    for item in items:
        out += [item] if isinstance(item, int) else \
            written[item].pop(0) if written.get(item) else tokenizer.encode_text(item)
    tail: list[int] = []
    for t in reversed(block):   # end tokens after the block, not its own
        if t not in special.end_ids or t in block_ends:
            break
        tail.insert(0, t)
    return out + tail


def _runs(ids: list[int], controls) -> list[list[int]]:
    """The runs of text tokens between control tokens."""
    out: list[list[int]] = [[]]
    for t in ids:
        if t in controls:
            out.append([])
        else:
            out[-1].append(t)
    return [r for r in out if r]
