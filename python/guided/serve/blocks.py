"""An assistant message as the ordered blocks the agent APIs stream:
reasoning text, answer text, and one block per tool call (the Responses
API's output items, the Messages API's content blocks).

The chat parser's deltas (OpenAI's chunk shape) come in; what goes out is
"start", "delta" and "stop" of each block in order, with one block open at
a time. A whole answer is the same deltas run through the same class, so
a streamed answer and a whole one always hold the same blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..chat.parser import ChatDelta


@dataclass
class Block:
    kind: str                 # "reasoning", "text" or "call"
    index: int                # its place in the message
    text: str = ""            # the text, or a call's arguments JSON
    call_id: str | None = None
    name: str | None = None
    call: int | None = None   # the parser's index of the call


@dataclass
class Event:
    what: str                 # "start", "delta" or "stop"
    block: Block
    delta: str = ""


@dataclass
class Blocks:
    blocks: list[Block] = field(default_factory=list)
    _open: Block | None = None

    def feed(self, deltas: list[ChatDelta]) -> list[Event]:
        events: list[Event] = []
        for d in deltas:
            if d.reasoning_content:
                events += self._text("reasoning", d.reasoning_content)
            if d.content:
                events += self._text("text", d.content)
            for part in d.tool_calls or []:
                events += self._call(part)
        return events

    def end(self) -> list[Event]:
        """The open block's stop, at the message's end."""
        return self._close()

    def _text(self, kind: str, text: str) -> list[Event]:
        events = []
        if self._open is None or self._open.kind != kind:
            events += self._start(Block(kind, len(self.blocks)))
        self._open.text += text
        return [*events, Event("delta", self._open, text)]

    def _call(self, part: dict) -> list[Event]:
        fn = part.get("function") or {}
        events = []
        if "id" in part:   # a call's first part: its id and name
            events += self._start(Block("call", len(self.blocks), call_id=part["id"],
                                        name=fn.get("name"), call=part["index"]))
        args = fn.get("arguments") or ""
        if args and self._open is not None and self._open.call == part["index"]:
            self._open.text += args
            events.append(Event("delta", self._open, args))
        return events

    def _start(self, block: Block) -> list[Event]:
        events = self._close()
        self.blocks.append(block)
        self._open = block
        return [*events, Event("start", block)]

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [Event("stop", block)]
