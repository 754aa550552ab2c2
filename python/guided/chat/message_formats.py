"""The message-format table: how each family frames an assistant message:
its reasoning block's markers and its answer's (harmony's final channel,
Command R7B's response token, GigaChat's end of message, Kimi K3's tags),
in the tool-format table's parts (Special, Lit).

A marker may be one token (`<think>`) or several tokens and text (harmony's
`<|channel|>analysis<|message|>`). From one row come the grammar's block
and answer (chat/grammar.py writes the parts), the parser's switches
(``MarkerReader`` below finds the parts in the token stream) and the
engine's reasoning budget (the end marker's first token, forced;
fast-forward writes the rest).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..special_tokens import SpecialTokens
from ..tokenizer import TokenizerWrapper
from .parts import Lit, Part, Special, resolve, tag


@dataclass(frozen=True)
class MessageFormat:
    name: str
    #: the reasoning block's markers; () where the family has none
    start: tuple[Part, ...] = ()
    end: tuple[Part, ...] = ()
    #: what opens the answer, after the block or in its place (harmony's
    #: final channel); () where the answer is bare text
    answer: tuple[Part, ...] = ()
    #: what the model writes after an answer that is not calls, where the
    #: grammar writes it (an end token of the message that does not end the
    #: turn for the grammar: GigaChat's <|message_sep|>, after which a call
    #: turn may follow)
    answer_end: tuple[Part, ...] = ()
    #: what ends the message after its answer and calls, before the end
    #: token (Kimi K3's message tag closed)
    message_end: tuple[Part, ...] = ()
    #: the calls come after the answer's frame, inside the message (Kimi
    #: K3's tools tag after its response tag: the answer is always written,
    #: empty before calls alone, and ``answer_end`` follows it), not in its
    #: place (harmony's call in the commentary channel, GigaChat's call
    #: turn, which begins with the token that ends an answer); there the
    #: parser reads ``answer_end`` and ``message_end`` as markers and drops them
    calls_after_answer: bool = False

    @property
    def reasoning(self) -> bool:
        return bool(self.start)

    def text(self, which: str, special: SpecialTokens) -> str:
        """The text of a marker ("start", "end", "answer", "answer_end" or "message_end") as a template writes it."""
        return "".join(resolve(p, special)[1] for p in getattr(self, which))


#: gpt-oss (harmony): the analysis channel, then a new assistant message in
#: the final channel (or a call in the commentary channel)
HARMONY = MessageFormat("harmony", start=(Special("<|channel|>"), Lit("analysis"), Special("<|message|>")),
                        end=(Special("<|end|>"), Special("<|start|>"), Lit("assistant")),
                        answer=(Special("<|channel|>"), Lit("final"), Special("<|message|>")))
#: Command R7B: a plan in thinking tokens before its actions, an answer in response tokens
COHERE = MessageFormat("command_r7b", start=(Special("<|START_THINKING|>"),), end=(Special("<|END_THINKING|>"),),
                       answer=(Special("<|START_RESPONSE|>"),))
#: Apriel 1.6: plain text; its generation prompt opens the block, which ends at
#: the final-response marker (text markers: the template must name them)
APRIEL = MessageFormat("apriel", start=(Lit("Here are my reasoning steps:\n"),),
                       end=(Lit("\n[BEGIN FINAL RESPONSE]\n"),))
#: Kimi K3: tag tokens; the reasoning in a think tag, the answer in a
#: response tag and the calls in a tools tag after it (tool_formats'
#: kimi_k3), inside the message tag the generation prompt opens
KIMI_K3 = MessageFormat("kimi_k3", start=tag("think"), end=tag("think", close=True), answer=tag("response"),
                        answer_end=tag("response", close=True), message_end=tag("message", close=True),
                        calls_after_answer=True)
#: <think>…</think> and the pairs the registry knows by role ([THINK], <seed:think>)
TAGS = MessageFormat("tags", start=(Special("<think>", "reasoning_start"),),
                     end=(Special("</think>", "reasoning_end"),))
#: GigaChat 3: the answer ends with <|message_sep|>, which a call turn may follow
GIGACHAT = MessageFormat("gigachat", answer_end=(Special("<|message_sep|>"),))
TABLE: tuple[MessageFormat, ...] = (HARMONY, COHERE, APRIEL, KIMI_K3, TAGS, GIGACHAT)


def find(special: SpecialTokens, template: str) -> MessageFormat | None:
    """The first row whose every marker is an added token of this model, and
    whose every text marker the template names (Apriel's)."""
    for row in TABLE:
        parts = (*row.start, *row.end, *row.answer, *row.answer_end, *row.message_end)
        if all(special.id(p.role) is not None if isinstance(p, Special) else p.text.strip() in template
               for p in parts):
            return row
    return None


def unwritten(row: MessageFormat | None, generation_prompt: str, special: SpecialTokens) -> MessageFormat | None:
    """The row's markers the model still writes after ``generation_prompt``:
    none of the answer's opening where the prompt wrote it (Kimi K3 with
    thinking off opens its response tag)."""
    if row is not None and row.answer and generation_prompt.endswith(row.text("answer", special)):
        return replace(row, answer=())
    return row


def text_only(parts: tuple[Part, ...]) -> str | None:
    """The text of a marker written as text alone (no token), else None."""
    return "".join(p.text for p in parts) if parts and all(isinstance(p, Lit) for p in parts) else None


def marker_ids(parts: tuple[Part, ...], special: SpecialTokens, tokenizer: TokenizerWrapper) -> list[int]:
    """The tokens a marker is written with (its text parts as plain text)."""
    out: list[int] = []
    for p in parts:
        tid, text = resolve(p, special)
        out += [tid] if tid is not None else tokenizer.encode_text(text)
    return out


class MarkerReader:
    """Finds markers that begin with a token in a token stream, token by
    token: control tokens by id, their text parts by its characters (however
    the text is split into tokens). Tokens that may still begin a marker are
    held until they do or cannot. (A marker of text alone, Apriel's, may
    begin inside a token: the parser looks for it in the text.)

    A marker may have several spellings (a call's beginnings: gpt-oss's
    `<|channel|>commentary to=functions.` and `<|channel|>analysis to=functions.`).
    A marker named in ``runs_on`` goes on into text of its own (the tool's
    name), which may share a token with its last characters: its tokens,
    ``matched``, are read on by the caller."""

    def __init__(self, special: SpecialTokens, tokenizer: TokenizerWrapper,
                 markers: dict[str, tuple[tuple[Part, ...], ...]], runs_on: frozenset[str] = frozenset()):
        self.special, self.tok, self.runs_on = special, tokenizer, runs_on
        self.patterns = {name: [marker_items(parts, special) for parts in spellings
                                if parts and text_only(parts) is None]
                         for name, spellings in markers.items()}
        self.held: list[int] = []
        self.matched: list[int] = []   # the tokens of the marker found last

    def push(self, t: int, active: tuple[str, ...]) -> tuple[str | None, list[int]]:
        """(the marker that token ``t`` completes, or None; the held tokens
        that turned out to be no marker, to be read as ordinary tokens)."""
        patterns = [(n, p) for n in active for p in self.patterns.get(n, ())]
        if not self.held and not any(p[0] == t for _, p in patterns):
            return None, [t]        # the common case: no marker starts here
        self.held.append(t)
        items = self._items(self.held)
        verdicts = [(name, _match(items, p, name in self.runs_on)) for name, p in patterns]
        done = next((name for name, v in verdicts if v == "whole"), None)
        if done is not None:
            self.matched, self.held = self.held, []
            return done, []
        if any(v == "prefix" for _, v in verdicts):
            return None, []
        # the first held token is no marker; the rest may begin one
        first, rest = self.held[0], self.held[1:]
        self.held = []
        released = [first]
        for k, r in enumerate(rest):
            done, more = self.push(r, active)
            released += more
            if done is not None:   # what followed it is read with the next token
                self.held = rest[k + 1:]
                return done, released
        return None, released

    def flush(self) -> list[int]:
        """The tokens still held (the output ended inside a marker)."""
        out, self.held = self.held, []
        return out

    def _items(self, ids: list[int]) -> list[int | str]:
        out: list[int | str] = []
        run: list[int] = []
        for t in ids:
            if t in self.special.control_ids:
                if run:
                    out.append(self.tok.decode(run))
                    run = []
                out.append(t)
            else:
                run.append(t)
        if run:
            out.append(self.tok.decode(run))
        return out


def marker_items(parts: tuple[Part, ...], special: SpecialTokens) -> list[int | str]:
    """Parts as control token ids and runs of text."""
    out: list[int | str] = []
    for p in parts:
        tid, text = resolve(p, special)
        if tid is not None:
            out.append(tid)
        elif out and isinstance(out[-1], str):
            out[-1] += text
        else:
            out.append(text)
    return out


def _match(items: list[int | str], pattern: list[int | str], runs_on: bool = False) -> str:
    """"whole", "prefix" (the items may still become the pattern) or "no".
    ``runs_on``: the pattern's last text may be followed by more in the same run."""
    for i, item in enumerate(items):
        if i >= len(pattern) or isinstance(item, int) != isinstance(pattern[i], int):
            return "no"
        if item == pattern[i]:
            continue
        last = i == len(items) - 1
        if runs_on and last and i == len(pattern) - 1 and isinstance(item, str) and item.startswith(pattern[i]):
            return "whole"
        return "prefix" if last and isinstance(item, str) and pattern[i].startswith(item) else "no"
    return "whole" if len(items) == len(pattern) else "prefix"
