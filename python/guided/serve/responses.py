"""POST /v1/responses: OpenAI's Responses API over the chat core.

The body's input items become one conversation in the chat layer's shape
(instructions → a system message; reasoning, message and function_call
items of one assistant turn → one assistant message; function_call_output
→ a tool message) and its fields become ChatOptions; what comes back is
output items (reasoning, message, function_call) or their typed events.

State: with ``store`` (OpenAI's default, true) a response's conversation
is kept in memory for ``previous_response_id`` and GET/DELETE
/v1/responses/{id}, the newest ``ResponseStore.capacity`` only (older ones
are dropped, and naming one is a 404). Nothing is written to disk.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..chat import ChatOptions
from ..chat.parser import ChatResponse
from ..chat.request import ChatPlan
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .blocks import Block, Blocks, Event
from .chat import ChatRun, open_chat, plan_chat
from .errors import APIError
from .state import ServerState, respond


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    # extensions (vLLM's names)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    on_length: str | None = None   # guided's own, as chat completions'

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                                  top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                                  seed=self.seed, repetition_penalty=self.repetition_penalty,
                                  on_length=self.on_length)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    def check(self) -> None:
        if self.background:
            raise APIError(400, "background responses are not supported", param="background")
        if self.max_tool_calls is not None:
            raise APIError(400, "max_tool_calls is not supported", param="max_tool_calls")
        if self.input is None and self.previous_response_id is None:
            raise APIError(400, "input is required", param="input")


class ResponseStore:
    """The conversations of the newest stored responses (OpenAI's ``store``),
    in memory, oldest dropped first."""

    capacity = 1024

    def __init__(self):
        self._kept: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> None:
        with self._lock:
            self._kept[response["id"]] = (conversation, response)
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> tuple[list[dict], dict]:
        with self._lock:
            if response_id not in self._kept:
                raise APIError(404, f"no stored response with id {response_id!r} (this server keeps "
                                    f"the newest {self.capacity} in memory)", param=param)
            return self._kept[response_id]

    def item(self, item_id) -> dict | None:
        """An output item of a stored response, by its id."""
        with self._lock:
            kept = [r for _, r in self._kept.values()]
        return next((o for r in kept for o in r["output"] if o.get("id") == item_id), None)

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        with self._lock:
            self._kept.pop(response_id, None)


# -- the body, as the chat layer takes it ----------------------------------


def conversation(body: ResponsesRequest, store: ResponseStore) -> list[dict]:
    """The whole conversation the request continues (without instructions,
    which are not carried from one response to the next)."""
    history = store.get(body.previous_response_id, "previous_response_id")[0] \
        if body.previous_response_id else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) \
        else (body.input or [])
    return _messages(items, history, store)


def _messages(items: list[dict], history: list[dict], store: ResponseStore) -> list[dict]:
    out = [dict(m) for m in history]
    calls = {c["id"]: c["function"]["name"] for m in history for c in m.get("tool_calls") or []}
    turn: dict | None = None   # the assistant message being gathered

    def assistant() -> dict:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": None}
            out.append(turn)
        return turn

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "item_reference":
            item = _referenced(item, store, where)
            kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be 'user', 'system', 'developer' or "
                                    f"'assistant'", param=where)
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                if turn is not None and (turn["content"] is not None or turn.get("tool_calls")):
                    turn = None
                assistant()["content"] = text
            else:
                turn = None
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "reasoning":
            if turn is not None and (turn["content"] is not None or turn.get("tool_calls")
                                     or "reasoning_content" in turn):
                turn = None
            parts = item.get("content") or item.get("summary") or []
            assistant()["reasoning_content"] = _text(parts, f"{where}.content")
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) for v in (call_id, name, args)):
                raise APIError(400, f"{where}: a function_call needs string call_id, name and "
                                    f"arguments", param=where)
            if turn is not None and turn["content"] is not None:
                turn = None
            assistant().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
            calls[call_id] = name
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in calls:
                raise APIError(400, f"{where}: function_call_output for call_id {call_id!r}, which no "
                                    f"function_call before it has", param=where)
            turn = None
            out.append({"role": "tool", "tool_call_id": call_id, "name": calls[call_id],
                        "content": _text(item.get("output"), f"{where}.output")})
        else:
            raise APIError(400, f"{where}.type {kind!r} is not supported: give message, reasoning, "
                                f"function_call, function_call_output or item_reference items",
                           param=where)
    if not out:
        raise APIError(400, "input is empty", param="input")
    return out


def _referenced(item: dict, store: ResponseStore, where: str) -> dict:
    """An item_reference: an output item of a stored response."""
    found = store.item(item.get("id"))
    if found is None:
        raise APIError(404, f"{where}: no stored item with id {item.get('id')!r}", param=where)
    return found


def _text(content, where: str) -> str:
    """A content field's text: a string, or text parts (input_text,
    output_text, reasoning_text, summary_text); other parts are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "reasoning_text", "summary_text",
                        "refusal"):
            raise APIError(400, f"{where}[{j}]: part type {kind!r} is not supported (text only)",
                           param=where)
        value = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(value, str):
            raise APIError(400, f"{where}[{j}] needs a string text", param=where)
        texts.append(value)
    return "".join(texts)


def chat_options(body: ResponsesRequest, tool_grammar: bool) -> ChatOptions:
    return ChatOptions(tools=_tools(body.tools), tool_choice=_tool_choice(body.tool_choice),
                       parallel_tool_calls=body.parallel_tool_calls,
                       response_format=_response_format(body.text),
                       reasoning_effort=(body.reasoning or {}).get("effort"),
                       tool_grammar=tool_grammar)


def _tools(tools: list[dict] | None) -> list[dict] | None:
    """Function tools in the chat layer's shape. Responses' ``strict``
    defaults to true, as OpenAI's."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, f"tools[{i}].type {tool.get('type')!r} is not supported: only "
                                f"function tools", param=f"tools[{i}]")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        fn["strict"] = tool.get("strict", True)
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice or "auto"
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("type") == "allowed_tools":   # Responses' flat tools, in chat completions' shape
        tools = choice.get("tools")
        listed = [{"type": "function", "function": {"name": t.get("name")}} if isinstance(t, dict) else t
                  for t in tools] if isinstance(tools, list) else tools
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": listed}}
    raise APIError(400, "tool_choice must be 'auto', 'none', 'required', "
                        "{'type': 'function', 'name': ...} or "
                        "{'type': 'allowed_tools', 'mode': ..., 'tools': [...]}", param="tool_choice")


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "text.format.type must be 'text', 'json_object' or 'json_schema'",
                       param="text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


# -- the answer, as output items -------------------------------------------


class _Items:
    """Output items built from the message's blocks, with their events."""

    def __init__(self):
        self.blocks = Blocks()
        self.ids: dict[int, str] = {}
        self.items: list[dict] = []

    def events(self, events: list[Event], whole_calls: frozenset[int]) -> list[dict]:
        """The API's events for the blocks' ``events``; ``whole_calls``: the
        calls whose arguments are whole (ChatParser.whole_calls)."""
        out = []
        for e in events:
            out += getattr(self, "_" + e.what)(e, whole_calls)
        return out

    def _start(self, e: Event, _done) -> list[dict]:
        b = e.block
        prefix = {"reasoning": "rs", "text": "msg", "call": "fc"}[b.kind]
        self.ids[b.index] = f"{prefix}_{uuid.uuid4().hex}"
        item = self._item(b, "in_progress")
        self.items.append(item)
        events = [{"type": "response.output_item.added", "output_index": b.index, "item": item}]
        if b.kind == "text":
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": b.index, "content_index": 0, "part": _text_part("")})
        return events

    def _delta(self, e: Event, _done) -> list[dict]:
        b = e.block
        head = {"item_id": self.ids[b.index], "output_index": b.index}
        if b.kind == "call":
            return [{"type": "response.function_call_arguments.delta", **head, "delta": e.delta}]
        kind = "output_text" if b.kind == "text" else "reasoning_text"
        extra = {"logprobs": []} if b.kind == "text" else {}
        return [{"type": f"response.{kind}.delta", **head, "content_index": 0, "delta": e.delta,
                 **extra}]

    def _stop(self, e: Event, whole_calls: frozenset[int]) -> list[dict]:
        b = e.block
        status = "completed" if b.kind != "call" or b.call in whole_calls else "incomplete"
        item = self.items[b.index] = self._item(b, status)
        head = {"item_id": item["id"], "output_index": b.index}
        events = []
        if b.kind == "call":
            events.append({"type": "response.function_call_arguments.done", **head,
                           "name": b.name, "arguments": b.text})
        elif b.kind == "text":
            events += [{"type": "response.output_text.done", **head, "content_index": 0,
                        "text": b.text, "logprobs": []},
                       {"type": "response.content_part.done", **head, "content_index": 0,
                        "part": _text_part(b.text)}]
        else:
            events.append({"type": "response.reasoning_text.done", **head, "content_index": 0,
                           "text": b.text})
        return [*events, {"type": "response.output_item.done", "output_index": b.index, "item": item}]

    def _item(self, b: Block, status: str) -> dict:
        done = status != "in_progress"
        item_id = self.ids[b.index]
        if b.kind == "reasoning":
            return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": b.text}] if done else []}
        if b.kind == "text":
            return {"type": "message", "id": item_id, "role": "assistant", "status": status,
                    "content": [_text_part(b.text)] if done else []}
        return {"type": "function_call", "id": item_id, "call_id": b.call_id, "name": b.name,
                "arguments": b.text if done else "", "status": status}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def response_plan(s: ServerState, store: ResponseStore, body: ResponsesRequest
                        ) -> tuple[ChatPlan, list[dict]]:
    """The chat plan of a Responses request, and the conversation it continues."""
    s.check_model(body.model)
    body.check()
    messages = conversation(body, store)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    options = chat_options(body, s.tool_grammar)
    given = body.max_output_tokens is not None
    params = body.sampling_params(body.max_output_tokens or s.max_model_len)
    plan = await plan_chat(s, system + messages, options, params, given,
                           tools=body.tools, text=body.text)
    return plan, messages


async def create_response(s: ServerState, store: ResponseStore, body: ResponsesRequest,
                          disconnected=None):
    plan, messages = await response_plan(s, store, body)
    chat = await open_chat(s, plan, 1, "responses", "resp_")
    items = _Items()
    created = time.time()
    base = {"id": chat.run.request_id, "object": "response", "created_at": created,
            "model": body.model or s.model_names[0], "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id, "reasoning": body.reasoning,
            "store": body.store, "temperature": body.temperature, "top_p": body.top_p,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "truncation": body.truncation or "disabled", "user": body.user,
            "error": None, "incomplete_details": None}

    def response(out: RequestOutput | None) -> dict:
        r = {**base, "status": "in_progress", "output": [dict(i) for i in items.items],
             "usage": None}
        if out is None:
            return r
        u = chat.usage([out])
        r["usage"] = {"input_tokens": u.prompt,
                      "input_tokens_details": {"cached_tokens": u.cached, "cache_write_tokens": 0},
                      "output_tokens": u.completion,
                      "output_tokens_details": {"reasoning_tokens": u.reasoning},
                      "total_tokens": u.prompt + u.completion}
        r["completed_at"] = time.time()
        r["closed"] = out.outputs[0].closed
        if out.finish_reason == "error":
            r["status"] = "failed"
            r["error"] = {"code": "server_error", "message": out.error or "generation failed"}
        elif out.finish_reason == "length":
            r["status"] = "incomplete"
            r["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            r["status"] = "completed"
        if body.store:
            reply = chat.parsers[0].result(out)
            store.put(r, messages + [_sent_back(reply)])
        return r

    def whole(outs) -> dict:
        deltas = chat.whole(0, outs[0])
        items.events(items.blocks.feed(deltas) + items.blocks.end(), chat.parsers[0].whole_calls)
        return response(outs[0])

    async def events():
        seq = 0

        def numbered(event: dict) -> dict:
            nonlocal seq
            seq += 1
            return {**event, "sequence_number": seq - 1}

        yield numbered({"type": "response.created", "response": response(None)})
        yield numbered({"type": "response.in_progress", "response": response(None)})
        async for _, u, deltas in chat.deltas():
            block_events = items.blocks.feed(deltas) + (items.blocks.end() if u.finished else [])
            for event in items.events(block_events, chat.parsers[0].whole_calls):
                yield numbered(event)
            if u.finished:
                final = response(u.finished)
                kind = {"completed": "response.completed", "failed": "response.failed",
                        "incomplete": "response.incomplete"}[final["status"]]
                yield numbered({"type": kind, "response": final})

    return await respond(chat.run, body.stream, events, whole, disconnected, typed_events=True)


def _sent_back(reply: ChatResponse) -> dict:
    """The assistant message as the next turn's conversation holds it."""
    return {k: v for k, v in reply.message().items() if v is not None or k == "content"}
