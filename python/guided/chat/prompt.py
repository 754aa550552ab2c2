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
import threading
from collections import Counter, OrderedDict
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
    in its recent answers (rule 6).

    A model under a grammar, or simply sampling, may write a text in tokens
    other than the tokenizer's own split of it, and the generation prompt's
    last characters may merge with the answer's first when the whole is
    tokenized again. Either would make the next turn's prompt leave the
    prefix cache where the answer starts. When a client sends an answer
    back, its text runs are tokenized as the model wrote them: the same text,
    the same tokens, the cache hit up to the new turn.

    A run is matched only where its answer comes back, so that it changes no
    other piece of the prompt. A run after a control token the model wrote
    comes back as a whole piece after that same control token. An answer's
    first run (when the answer starts with text) comes back in one piece
    with the text its prompt ended with: after the prompt's last control
    token, that text, then the run ("assistant\n" + the answer; Qwen3.5's
    "\n" after <think> + the "\n" the model writes before </think>). The
    ends of recent prompts are kept (``prompt_end``), and a first run is
    matched only in a piece that is such an end followed by the run,
    wholly: "\n" written before </think> must not re-split the "\n\n" that
    ends a paragraph of the system prompt, and the "\n\n" a model writes
    between </think> and a call must not re-split the "\n" + "\n" of a
    reasoning block it left empty.
    """

    _KEPT = 8           # tokenizations kept per run
    _ENDS_KEPT = 64     # prompt ends kept (a template has one or two; continued messages add theirs)

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        #: (text, the control token before it, or None for an answer's first
        #: run) → the tokenizations the model wrote it in, oldest first
        self._runs: OrderedDict[tuple[str, int | None], list[list[int]]] = OrderedDict()
        #: (a prompt's last control token or None, the text after it) of recent prompts
        self._ends: OrderedDict[tuple[int | None, str], None] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, ids: list[int], special: SpecialTokens, tokenizer: TokenizerWrapper) -> None:
        run: list[int] = []
        after: int | None = None    # the control token before the run; None: the answer's start
        for t in [*ids, None]:
            if t is not None and t not in special.control_ids:
                run.append(t)
                continue
            if run:
                self._put_run(run, after, tokenizer)
                # the answer's last run, less the whitespace a model may
                # write after its last call (the grammar's _trailing), which
                # no template writes back
                bare = len(run)
                while bare and not tokenizer.decode(run[bare - 1:bare]).strip():
                    bare -= 1
                if (t is None or t in special.end_ids) and 0 < bare < len(run):
                    self._put_run(run[:bare], after, tokenizer)
            run = []
            after = t

    def prompt_end(self, control: int | None, text: str) -> None:
        """A prompt the model answers ends with ``control`` (None: no control
        token in it) and ``text`` after it: its answer's first run comes
        back after them."""
        with self._lock:
            self._ends[(control, text)] = None
            self._ends.move_to_end((control, text))
            while len(self._ends) > self._ENDS_KEPT:
                self._ends.popitem(last=False)

    def _put_run(self, run: list[int], after: int | None, tokenizer: TokenizerWrapper) -> None:
        text = tokenizer.decode(run, skip_special_tokens=False)
        if "\ufffd" not in text:
            self._put(text, run, after)

    def _put(self, text: str, ids: list[int], after: int | None) -> None:
        with self._lock:
            key = (text, after)
            kept = self._runs.setdefault(key, [])
            kept.append(list(ids))
            del kept[:-self._KEPT]
            self._runs.move_to_end(key)
            while len(self._runs) > self.capacity:
                self._runs.popitem(last=False)

    def encode(self, piece: str, after: int | None, tokenizer: TokenizerWrapper,
               occurrence: int = 0, count: int = 1) -> list[int]:
        """``piece`` (after the control token ``after``; None: at the prompt's
        start) as tokens. A piece that is a prompt's end and then an
        answer's first run (the longest such run) is the end in the
        tokenizer's tokens and the run in the model's; else a run the model
        wrote after ``after`` that is the whole piece keeps its tokens. Where
        the same text comes ``count`` times after the same control token in
        one prompt (one tool called each turn), the last occurrences take
        the latest tokenizations, in order."""
        head, first = None, None
        with self._lock:
            for control, text in self._ends:
                if control == after and len(text) < len(piece) and piece.startswith(text) \
                        and (head is None or len(text) < len(head)) \
                        and (kept := self._runs.get((piece[len(text):], None))):
                    head, first = text, list(kept[-1])
            # (a first run's key holds None: no piece at a prompt's start takes it whole)
            whole = self._runs.get((piece, after)) if first is None and after is not None else None
            if whole:
                return list(whole[max(0, len(whole) - count + occurrence)])
        if first is None:
            return tokenizer.encode_text(piece)
        return (tokenizer.encode_text(head) if head else []) + first


def tokenize_rendered(text: str, special: SpecialTokens, tokenizer: TokenizerWrapper,
                      escaper: ControlEscaper, memo: CompletionMemo | None = None) -> list[int]:
    """Token ids of a rendered prompt: added-token texts (the template's) as
    their ids, everything between as plain text with the client's characters
    restored (and the model's own tokens for text it wrote, from ``memo``,
    which learns where this prompt ends: its answer starts there)."""
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
    # the part before each part: for a piece, its control token (None at the prompt's start)
    before = [parts[i - 1] if i else None for i in range(len(parts))]
    counts = Counter((p, b) for p, b in zip(parts, before) if isinstance(p, str))
    seen: Counter = Counter()
    ids: list[int] = []
    for part, after in zip(parts, before):
        if isinstance(part, int):
            ids.append(part)
        elif memo is None:
            ids += tokenizer.encode_text(part)
        else:
            ids += memo.encode(part, after, tokenizer, seen[part, after], counts[part, after])
            seen[part, after] += 1
    if memo is not None:   # the answer starts where the prompt ends
        if parts and isinstance(parts[-1], str):
            memo.prompt_end(before[-1], parts[-1])
        else:
            memo.prompt_end(parts[-1] if parts else None, "")
    return ids


def rendered_back(ids: list[int], block: list[int], block_prefix: str, runs: list[int | str],
                  special: SpecialTokens, tokenizer: TokenizerWrapper, block_ends: frozenset[int]) -> list[int]:
    """An answer's tokens ``ids`` with its calls block (its last tokens,
    ``block``, and ``block_prefix``, the block's text that tokens before it
    hold: a text trigger) as the template renders it back (``runs``: its
    marker tokens and texts, tool_formats.ToolFormat.rendered_runs): each
    text in the model's tokens where the model wrote that text, in the
    tokenizer's elsewhere. Remembered so (CompletionMemo), a text the
    template writes in every call turn ("commentary json") keeps one
    tokenization per turn it comes back from, in order, where the model
    wrote some calls otherwise (gpt-oss's other spellings)."""
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
