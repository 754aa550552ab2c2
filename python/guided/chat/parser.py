"""Splitting an assistant message into reasoning, content and tool calls,
by token id (DESIGN.md rule 11), as it streams.

One parser serves both streaming and whole outputs: ``push`` takes the
tokens of each step and returns OpenAI-shaped deltas; ``result`` is the
sum of all deltas. Control tokens never become text. Inside a calls block
the text is parsed against the format's parts (tool_formats.py) by
calls.py; a block that does not parse (only possible without the tool
grammar) is returned as content rather than lost.

What the APIs read besides the deltas are the properties ``called_tools``
(whether tools were called), ``whole_calls`` (which calls are whole) and
``reasoning_tokens``; the rest of the parser's state is its own.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Callable

from ..outputs import RequestOutput
from ..special_tokens import SpecialTokens
from ..tokenizer import IncrementalDetokenizer, TokenizerWrapper
from .calls import ParsedCall, ReadState, parse_calls
from .message_formats import TAGS, MarkerReader, MessageFormat, text_only
from .prompt import rendered_back
from .parts import CALL_ID, head, resolve
from .tool_formats import DetectedFormat, JsonArgs, specials


@dataclass
class ChatDelta:
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None
    finish_reason: str | None = None   # only on a stream's last delta
    error: str | None = None


@dataclass
class ChatResponse:
    """One assistant message, as every API hands it back. tool_calls are in
    OpenAI's shape (arguments is a JSON string); finish_reason is
    "tool_calls" when the model called tools."""

    content: str | None
    finish_reason: str
    reasoning_content: str | None = None
    tool_calls: list[dict] = field(default_factory=list)
    output: RequestOutput | None = None   # the engine's output (tokens, usage, error)

    def message(self) -> dict:
        """The assistant message in OpenAI's shape: what an API returns, and
        what a client sends back next turn."""
        m = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            m["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        return m


class ChatParser:
    def __init__(self, special: SpecialTokens, tokenizer: TokenizerWrapper,
                 tools: DetectedFormat | None, tool_schemas: dict[str, dict] | None,
                 reasoning: tuple[str, str, str] | None, reasoning_state: str | None,
                 on_finish: Callable[[list[int]], None] | None = None, stop: list[str] = (),
                 markers: MessageFormat | None = None):
        self.special, self.tok = special, tokenizer
        self.stop = [s for s in stop if s]           # stop strings: the content ends before one
        self.tools = tools if tool_schemas else None
        self.schemas = tool_schemas or {}
        self.layout = reasoning                      # (open, close, after) whitespace
        self.mode = "reasoning" if reasoning_state == "open" else "content"
        self.after_reasoning = reasoning_state is not None
        # the reasoning block's markers and the answer's opening (harmony's
        # channels), found however many tokens they take
        m = markers or TAGS
        self._triggers, calls = self._call_triggers(m)
        # the answer's end and the message's, where calls follow them (Kimi K3's tags), are read and dropped
        closers = {"answer_end": (m.answer_end,), "message_end": (m.message_end,)} if m.calls_after_answer else {}
        self._markers = MarkerReader(special, tokenizer, {"start": (m.start,), "end": (m.end,), "answer": (m.answer,),
                                                          "call": calls, **closers}, runs_on=frozenset({"call"}))
        # an end marker of text alone (Apriel's) is found in the reasoning's text, wherever tokens split it
        self._end_text = text_only(m.end)
        self._answered = False
        # end tokens the calls block itself writes (harmony's <|call|>) are part of its text
        self._block_ends = frozenset(resolve(p, special)[0] for p in specials(self.tools.format)) \
            & special.end_ids if self.tools is not None else frozenset()
        self._reasoning_detok = IncrementalDetokenizer(tokenizer)
        # the reasoning's tokens as the engine's budget counts them: the text the
        # model wrote in the block, less the template's opening where it opened the block
        self._reasoning_count, self._opening = 0, ""
        self._content_detok = IncrementalDetokenizer(tokenizer)
        self.region: list[int] = []                  # tokens of the calls block
        self.region_prefix = ""                      # its text before them (text triggers)
        # the block's text as it streams, read on from where the last read stopped
        self._stream, self._run = "", IncrementalDetokenizer(tokenizer)
        self._read = ReadState()
        self.sent_reasoning = self.sent_content = 0  # characters already emitted
        self.sent_calls: list[tuple[bool, int]] = [] # per call: header sent, args chars sent
        self._call_ids: list[str] = []
        self._done_calls: set[int] = set()
        self._id_prefix = uuid.uuid4().hex[:16]
        self.broken = False                          # the calls block did not parse
        self._whole: list[ParsedCall] = []           # the calls block's whole calls, at the end
        self.finished = False
        self.ids: list[int] = []                     # every token pushed
        self.on_finish = on_finish
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[tuple[str, str]] = []      # (name, arguments) as streamed

    # -- tokens in ------------------------------------------------------

    def push(self, token_ids: list[int]) -> list[ChatDelta]:
        self.ids += token_ids
        for t in token_ids:
            self._route(t)
        return self._record(self._deltas(final=False))

    def _route(self, t: int) -> None:
        if self.mode == "calls":
            self._region_push(t)
            return
        marker, plain = self._markers.push(t, self._active_markers())
        for u in plain:
            self._route_plain(u)
        if marker == "call":   # its tokens, and those held after them, begin the calls block
            self.mode = "calls"
            for u in self._markers.matched + self._markers.flush():
                self._region_push(u)
        elif marker == "start":
            self.mode = "reasoning"
            self._opening = self.layout[0] if self.layout is not None else ""
        elif marker == "end":
            self.mode, self.after_reasoning = "content", True
        elif marker == "answer":
            self._answered = True

    def _call_triggers(self, m: MessageFormat) -> tuple[frozenset[int], tuple]:
        """The tokens that open a calls block by themselves, and the
        beginnings of calls read as markers: those whose first token also
        begins one of the message's markers (gpt-oss's `<|channel|>`, which
        opens the reasoning block and the answer too, opens a call in
        `<|channel|>analysis to=functions.`)."""
        if self.tools is None:
            return frozenset(), ()
        fmt = self.tools.format
        shared = {resolve(p[0], self.special)[0] for p in (m.start, m.end, m.answer) if p}
        tokens, leads = set(), []
        for first in fmt.triggers:
            tid = resolve(first, self.special)[0]
            starts = [head(s) for s in ((fmt.open,) if fmt.open else fmt.spellings) if s[0] == first]
            if tid is not None and tid in shared and all(len(h) > 1 for h in starts):
                leads += starts
            elif tid is not None:
                tokens.add(tid)
        return frozenset(tokens), tuple(dict.fromkeys(leads))

    def _active_markers(self) -> tuple[str, ...]:
        if self.mode == "reasoning":
            return ("end",)
        if self.mode == "calls":
            return ()
        if self._content_detok.ids:
            return ("call", "answer_end", "message_end")
        return ("answer",) * (not self._answered) + ("start",) * (self.layout is not None) + \
            ("call", "answer_end", "message_end")

    def finish(self) -> list[ChatDelta]:
        """The deltas still held back (trailing whitespace), at the end."""
        if self.finished:
            return []
        self.finished = True
        for t in self._markers.flush():   # the output ended inside a marker
            self._route_plain(t)
        deltas = self._record(self._deltas(final=True))
        if self.on_finish is not None:
            self.on_finish(self._rendered_back())
        return deltas

    def finish_reason(self, out: RequestOutput) -> str:
        """OpenAI's finish_reason for the message that ended as ``out``:
        "tool_calls" when it stopped after calling tools."""
        return "tool_calls" if out.finish_reason == "stop" and self.called_tools else out.finish_reason

    def result(self, out: RequestOutput) -> ChatResponse:
        """The whole message that ended as ``out`` (its tokens already
        pushed): the sum of every delta, streamed or not."""
        self.finish()
        calls = [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                 for i, (cid, (name, args)) in enumerate(zip(self._call_ids, self._calls))
                 if i in self._done_calls]  # a call cut by max_tokens is not a call
        return ChatResponse(content="".join(self._content) or None,
                            finish_reason=self.finish_reason(out),
                            reasoning_content="".join(self._reasoning) or None, tool_calls=calls,
                            output=out)

    # -- what the message holds so far (read by the APIs) ----------------

    @property
    def called_tools(self) -> bool:
        """Whether the message has called a tool: a call's id and name were
        emitted (whole or not)."""
        return bool(self._call_ids)

    @property
    def whole_calls(self) -> frozenset[int]:
        """The indexes of the tool calls whose arguments are whole; a call
        cut by the budget stays out (it is not a call)."""
        return frozenset(self._done_calls)

    @property
    def reasoning_tokens(self) -> int:
        """The tokens the model wrote as the reasoning block's text so far, as
        the reasoning budget counts them (usage's reasoning_tokens): its
        markers and, where the model opened the block, the template's opening
        whitespace are not the reasoning's."""
        return self._reasoning_count

    def _record(self, deltas: list[ChatDelta]) -> list[ChatDelta]:
        for d in deltas:
            if d.content:
                self._content.append(d.content)
            if d.reasoning_content:
                self._reasoning.append(d.reasoning_content)
            for call in d.tool_calls or []:
                i, fn = call["index"], call["function"]
                if i == len(self._calls):
                    self._calls.append((fn["name"], ""))
                name, args = self._calls[i]
                self._calls[i] = (name, args + fn.get("arguments", ""))
        return deltas

    def _route_plain(self, t: int) -> None:
        """A token that is no reasoning or answer marker."""
        s = self.special
        if self.mode == "calls":
            self._region_push(t)
        elif self.mode == "reasoning":
            if t not in s.control_ids:
                self._reasoning_detok.push(t)
                if not (self._opening and self._opening.startswith(self._reasoning_detok.text)):
                    self._reasoning_count += 1
                self._split_text_end()
        elif self.tools is not None and self._is_trigger(t):
            self.mode = "calls"
            self._region_push(t)
        elif t not in s.control_ids:
            self._content_detok.push(t)
            self._split_text_trigger()

    def _split_text_end(self) -> None:
        """Where the reasoning's text holds its end marker (of text), the
        reasoning stops there and what follows it is content."""
        text = self._reasoning_detok.text
        at = text.find(self._end_text) if self._end_text else -1
        if at < 0:
            return
        self._reasoning_detok.text = text[:at]
        self.mode, self.after_reasoning = "content", True
        self._content_detok.text += text[at + len(self._end_text):]
        self._split_text_trigger()

    def _is_trigger(self, t: int) -> bool:
        return t in self._triggers

    def _text_triggers(self) -> tuple[str, ...]:
        """The texts that open a calls block, for formats whose block starts
        with text (Llama's bare JSON, the text envelope, markers the
        tokenizer has no token for, gpt-oss's ` to=functions.`)."""
        if self.tools is None:
            return ()
        return tuple(text for tid, text in (resolve(p, self.special) for p in self.tools.format.triggers)
                     if tid is None)

    def _split_text_trigger(self) -> None:
        triggers = self._text_triggers()
        if not triggers:
            return
        text = self._content_detok.text
        at = 0 if text.startswith(triggers) else -1
        if self.tools.content_sep is not None:
            at = min((i for t in triggers if (i := text.find(t)) >= 0), default=-1)
        if at < 0:
            return
        self.region_prefix = self._stream = text[at:]
        self._content_detok.text = text[:at]
        self.mode = "calls"

    def _region_push(self, t: int) -> None:
        """A token of the calls block: its text joins the streamed text (a
        control token's as its text, as region_text writes it)."""
        self.region.append(t)
        if t not in self.special.control_ids:
            self._stream += self._run.push(t)
            return
        if self._run.ids:   # what the run held back (a character cut between tokens)
            self._stream += self.tok.decode(self._run.ids)[len(self._run.text):]
            self._run = IncrementalDetokenizer(self.tok)
        if t not in self.special.end_ids or t in self._block_ends:
            self._stream += self.special.text(t)

    # -- text out -------------------------------------------------------

    def region_text(self, controls: bool = True) -> str:
        """The calls block as text; control tokens as their text (for parsing
        against the format) or left out (for showing a broken block)."""
        out, run = [self.region_prefix], []
        for t in self.region:
            if t in self.special.control_ids:
                out.append(self.tok.decode(run) if run else "")
                run = []
                if controls and (t not in self.special.end_ids or t in self._block_ends):
                    out.append(self.special.text(t))
            else:
                run.append(t)
        out.append(self.tok.decode(run) if run else "")
        return "".join(out)

    def _visible_reasoning(self) -> str:
        """The reasoning less the newlines the template writes around it
        (`<think>\n…\n</think>`); where it writes none (harmony's channels),
        the model's own newlines are the reasoning's, kept so that it renders
        back the same."""
        text = self._reasoning_detok.text
        if self.mode == "reasoning" and self._end_text:   # what may still begin the end marker
            text = text[:len(text) - _partial_end(text, self._end_text)]
        if self.layout is not None and self.layout[0]:
            text = text.lstrip("\n")
        return text.rstrip("\n") if self.layout is None or self.layout[1] else text

    def _visible_content(self, final: bool, calls: list[ParsedCall]) -> str:
        text = self._content_detok.text
        if self.after_reasoning and (self.layout is None or self.layout[2]):
            text = text.lstrip("\n")
        hits = [i for s in self.stop if (i := text.find(s)) >= 0]
        if hits:   # the engine ended the answer there; the stop string is not content
            return text[:min(hits)]
        if self.mode == "calls" and not self.broken:
            if not text.strip():
                return ""   # the template's whitespace before a call-only answer's calls
            sep = self.tools.content_sep or ""
            return text[:-len(sep)] if sep and text.endswith(sep) else text
        if final:
            return text + (self.region_text(controls=False) if self.broken or self.mode == "calls" else "")
        # hold back what could still be a separator or the start of a text trigger
        # and what could still be the start of a stop string
        held = len(text) - len(text.rstrip("\n"))
        triggers = self._text_triggers()
        for word in [*triggers, *self.stop]:
            if k := _partial_end(text, word):
                if word in triggers:   # and the whitespace before it: a call-only answer's lead
                    k = len(text) - len(text[:len(text) - k].rstrip())
                held = max(held, k)
        return text[:len(text) - held]

    def _deltas(self, final: bool) -> list[ChatDelta]:
        calls = self._parse_calls(final) if self.mode == "calls" else []
        if final:
            self._whole = [c for c in calls if c.done]
        out = []
        reasoning = self._visible_reasoning()
        if len(reasoning) > self.sent_reasoning:
            out.append(ChatDelta(reasoning_content=reasoning[self.sent_reasoning:]))
            self.sent_reasoning = len(reasoning)
        content = self._visible_content(final, calls)
        if len(content) > self.sent_content:
            out.append(ChatDelta(content=content[self.sent_content:]))
            self.sent_content = len(content)
        if not self.broken:
            out += self._call_deltas(calls)
        return out

    def _call_deltas(self, calls: list[ParsedCall]) -> list[ChatDelta]:
        out = []
        if self.tools is None:
            return out
        fmt = self.tools.format
        needs_id = fmt.writes(CALL_ID) or fmt.id_template is not None
        for i, call in enumerate(calls):
            if call.name is None or (needs_id and call.call_id is None and call.index is None):
                break
            if fmt.id_template is not None and call.call_id is None:
                call.call_id = fmt.id_template.format(name=call.name, index=call.index)
            if i == len(self.sent_calls):
                self._call_ids.append(call.call_id or self.tools.new_call_id(self._id_prefix, i))
                self.sent_calls.append((True, 0))
                out.append(ChatDelta(tool_calls=[{"index": i, "id": self._call_ids[i], "type": "function",
                                                  "function": {"name": call.name, "arguments": ""}}]))
            if call.done:
                self._done_calls.add(i)
            elif not isinstance(self.tools.format.args, JsonArgs):
                break  # XML arguments become JSON only once the call is whole
            sent = self.sent_calls[i][1]
            if len(call.args) > sent:
                out.append(ChatDelta(tool_calls=[{"index": i, "function": {"arguments": call.args[sent:]}}]))
                self.sent_calls[i] = (True, len(call.args))
        return out

    def _rendered_back(self) -> list[int]:
        """The answer's tokens as the template renders it back in the next
        turn's prompt, for the memo of the model's own tokens (rule 6): the
        tokens pushed, unless the model wrote a call in a spelling the
        template does not render (tool_formats.OneOf): then with the calls
        block as the template renders it (prompt.rendered_back)."""
        if self.broken or not any(c.spelling for c in self._whole):
            return self.ids
        calls = [{"name": c.name, "arguments": json.loads(c.args), "id": c.call_id or ""} for c in self._whole]
        return rendered_back(self.ids, self.region, self.region_prefix,
                             self.tools.format.rendered_runs(calls, self.special), self.special, self.tok,
                             self._block_ends)

    # -- the calls block ------------------------------------------------

    def _parse_calls(self, final: bool) -> list[ParsedCall]:
        if not final:   # read on from the last read: a step costs what it adds
            return parse_calls(self._stream, self.tools, self.schemas, self.special, self._read)[0]
        calls, ok = parse_calls(self.region_text(), self.tools, self.schemas, self.special)
        if final and not (ok and calls and all(c.done for c in calls)):
            # A block cut short (the budget, with no grammar to close it)
            # keeps its whole calls; the cut one is dropped, never shown as
            # text. A block that is not of the format is text, unless calls
            # were already streamed (never taken back).
            self.broken = not ok and not self.sent_calls
            return [c for c in calls if c.done] if ok or self.sent_calls else []
        return calls


def _partial_end(text: str, word: str) -> int:
    """The length of the longest end of ``text`` that begins ``word`` (and
    is shorter than it)."""
    for k in range(min(len(word) - 1, len(text)), 0, -1):
        if word.startswith(text[-k:]):
            return k
    return 0
