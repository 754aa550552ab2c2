"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages
API over the chat core.

The body becomes one conversation in the chat layer's shape (system →
a system message; text, thinking and tool_use blocks of an assistant turn →
one assistant message; each tool_result block → a tool message) and its
fields become ChatOptions (thinking.budget_tokens → the reasoning budget,
tool_choice any → required); what comes back is content blocks (thinking,
text, tool_use) or Anthropic's stream events. Errors on these paths are in
Anthropic's shape (errors.py).
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..chat import ChatOptions
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .blocks import Block, Blocks, Event
from .chat import ChatRun, open_chat, plan_chat
from .errors import APIError
from .state import ServerState, respond

#: Anthropic's output_config.effort, in the chat layer's efforts.
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None

    def conversation(self) -> list[dict]:
        return _system(self.system) + _messages(self.messages)

    def chat_options(self, tool_grammar: bool, max_tokens: int | None = None) -> ChatOptions:
        choice, parallel = _tool_choice(self.tool_choice)
        effort, budget = _thinking(self.thinking, max_tokens)
        config = self.output_config or {}
        if config.get("effort") is not None:
            if config["effort"] not in _EFFORTS:
                raise APIError(400, f"output_config.effort must be one of {', '.join(_EFFORTS)}",
                               param="output_config.effort")
            effort = effort or _EFFORTS[config["effort"]]
        return ChatOptions(tools=_tools(self.tools), tool_choice=choice, parallel_tool_calls=parallel,
                           response_format=_format(config.get("format")), reasoning_effort=effort,
                           reasoning_budget=budget, tool_grammar=tool_grammar)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float = Field(default=1.0, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    on_length: str | None = None   # guided's own, as chat completions'

    def sampling_params(self) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature,
                                  top_p=self.top_p or 1.0, top_k=self.top_k or 0,
                                  stop=list(self.stop_sequences or []), on_length=self.on_length)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None


# -- the body, as the chat layer takes it ----------------------------------


def _system(system) -> list[dict]:
    if system is None:
        return []
    text = system if isinstance(system, str) else _texts(system, "system")
    return [{"role": "system", "content": text}] if text else []


def _messages(messages: list[AnthropicMessage]) -> list[dict]:
    out: list[dict] = []
    calls: dict[str, str] = {}   # tool_use id → name
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        if m.role == "assistant":
            message: dict = {"role": "assistant", "content": None}
            for j, block in enumerate(blocks):
                kind = block.get("type") if isinstance(block, dict) else None
                if kind == "text":
                    message["content"] = (message["content"] or "") + _string(block, "text", f"{where}[{j}]")
                elif kind == "thinking":
                    message["reasoning_content"] = _string(block, "thinking", f"{where}[{j}]")
                elif kind == "tool_use":
                    call_id, name = block.get("id"), block.get("name")
                    if not isinstance(call_id, str) or not isinstance(name, str) or \
                            not isinstance(block.get("input"), dict):
                        raise APIError(400, f"{where}[{j}]: a tool_use block needs a string id and name "
                                            f"and an object input", param=where)
                    message.setdefault("tool_calls", []).append(
                        {"id": call_id, "type": "function", "function": {
                            "name": name, "arguments": json.dumps(block["input"], ensure_ascii=False)}})
                    calls[call_id] = name
                else:
                    raise APIError(400, f"{where}[{j}]: block type {kind!r} is not supported in an "
                                        f"assistant message (text, thinking, tool_use)", param=where)
            out.append(message)
            continue
        text: list[str] = []
        for j, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text.append(_string(block, "text", f"{where}[{j}]"))
            elif kind == "tool_result":
                call_id = block.get("tool_use_id")
                if call_id not in calls:
                    raise APIError(400, f"{where}[{j}]: tool_result for tool_use_id {call_id!r}, which "
                                        f"no tool_use block before it has", param=where)
                content = block.get("content", "")
                result = content if isinstance(content, str) else _texts(content, f"{where}[{j}].content")
                out.append({"role": "tool", "tool_call_id": call_id, "name": calls[call_id],
                            "content": result})
            else:
                raise APIError(400, f"{where}[{j}]: block type {kind!r} is not supported in a user "
                                    f"message (text, tool_result)", param=where)
        if text or not blocks:
            out.append({"role": "user", "content": "".join(text)})
    return out


def _string(block: dict, key: str, where: str) -> str:
    if not isinstance(block.get(key), str):
        raise APIError(400, f"{where}: a {block.get('type')} block needs a string {key}", param=where)
    return block[key]


def _texts(blocks, where: str) -> str:
    if not isinstance(blocks, list):
        raise APIError(400, f"{where} must be a string or a list of text blocks", param=where)
    out = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise APIError(400, f"{where}[{j}]: block type {kind!r} is not supported (text only)",
                           param=where)
        out.append(_string(block, "text", f"{where}[{j}]"))
    return "".join(out)


def _tools(tools: list[dict] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom" or "input_schema" not in tool:
            raise APIError(400, f"tools[{i}]: only client tools with an input_schema are supported "
                                f"(type {tool.get('type')!r})", param=f"tools[{i}]")
        # in the order OpenAI's clients send, so that a tool renders the
        # same whichever API brought it
        fn = {"name": tool.get("name"), "description": tool.get("description"),
              "parameters": tool["input_schema"], "strict": tool.get("strict")}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def _tool_choice(choice: dict | None) -> tuple[Any, bool]:
    """(the chat layer's tool_choice, parallel tool calls)."""
    if choice is None:
        return "auto", True
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(400, "tool_choice.type must be 'auto', 'any', 'tool' (with a name) or 'none'",
                   param="tool_choice")


def _thinking(thinking: dict | None, max_tokens: int | None) -> tuple[str | None, int | None]:
    """(reasoning effort, reasoning budget)."""
    if thinking is None:
        return None, None
    kind = thinking.get("type")
    if kind == "disabled":
        return "none", None
    if kind == "adaptive":
        return None, None
    if kind != "enabled":
        raise APIError(400, "thinking.type must be 'enabled', 'disabled' or 'adaptive'",
                       param="thinking.type")
    budget = thinking.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise APIError(400, "thinking.budget_tokens must be a positive integer",
                       param="thinking.budget_tokens")
    if max_tokens is not None and budget >= max_tokens:
        raise APIError(400, f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                            f"({max_tokens})", param="thinking.budget_tokens")
    return None, budget


def _format(fmt: dict | None) -> dict | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or \
            not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                       param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


# -- the answer, as content blocks -------------------------------------------


def _block(b: Block, done: bool) -> dict:
    if b.kind == "reasoning":
        return {"type": "thinking", "thinking": b.text if done else "", "signature": ""}
    if b.kind == "text":
        return {"type": "text", "text": b.text if done else ""}
    args = {}
    if done:
        try:
            args = json.loads(b.text or "{}")
        except ValueError:   # a call cut short by max_tokens
            args = {}
    return {"type": "tool_use", "id": b.call_id, "name": b.name, "input": args}


def _stream_events(events: list[Event]) -> list[dict]:
    out = []
    for e in events:
        b = e.block
        if e.what == "start":
            out.append({"type": "content_block_start", "index": b.index,
                        "content_block": _block(b, done=False)})
        elif e.what == "stop":
            out.append({"type": "content_block_stop", "index": b.index})
        else:
            delta = {"reasoning": {"type": "thinking_delta", "thinking": e.delta},
                     "text": {"type": "text_delta", "text": e.delta},
                     "call": {"type": "input_json_delta", "partial_json": e.delta}}[b.kind]
            out.append({"type": "content_block_delta", "index": b.index, "delta": delta})
    return out


def _stop(out: RequestOutput, chat: ChatRun) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if out.finish_reason == "length":
        return "max_tokens", None
    if chat.parsers[0].called_tools:
        return "tool_use", None
    reason = out.outputs[0].stop_reason
    if isinstance(reason, str):
        return "stop_sequence", reason
    return "end_turn", None


def _usage(chat: ChatRun, out: RequestOutput | None) -> dict:
    """Anthropic's usage: the thinking blocks' tokens in
    output_tokens_details.thinking_tokens, part of output_tokens."""
    u = chat.usage([out] if out is not None else [])
    return {"input_tokens": u.prompt - u.cached, "output_tokens": u.completion,
            "output_tokens_details": {"thinking_tokens": u.reasoning},
            "cache_read_input_tokens": u.cached, "cache_creation_input_tokens": 0}


async def create_message(s: ServerState, body: MessagesRequest, disconnected=None):
    s.check_model(body.model)
    options = body.chat_options(s.tool_grammar, body.max_tokens)
    if options.reasoning_budget is not None and s.llm.chat_format.reasoning is None:
        raise APIError(400, "thinking: this model's template and tokenizer have no reasoning block",
                       param="thinking")
    plan = await plan_chat(s, body.conversation(), options, body.sampling_params(), True,
                           tools=body.tools, output_config=body.output_config)
    chat = await open_chat(s, plan, 1, "messages", "msg_")
    blocks = Blocks()
    head = {"id": chat.run.request_id, "type": "message", "role": "assistant",
            "model": body.model}

    def failed(out: RequestOutput) -> bool:
        return out.finish_reason == "error"

    def whole(outs) -> dict:
        out, parser = outs[0], chat.parsers[0]
        if failed(out):
            raise APIError(500, out.error or "generation failed")
        blocks.feed(chat.whole(0, out))
        blocks.end()
        content = [_block(b, done=True) for b in blocks.blocks
                   if b.kind != "call" or b.call in parser.whole_calls]
        stop_reason, stop_sequence = _stop(out, chat)
        return {**head, "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": _usage(chat, out),
                "closed": out.outputs[0].closed}

    async def events():
        start = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": len(chat.prompt_ids), "output_tokens": 0,
                           "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}}
        yield {"type": "message_start", "message": start}
        yield {"type": "ping"}
        async for _, u, deltas in chat.deltas():
            for event in _stream_events(blocks.feed(deltas) + (blocks.end() if u.finished else [])):
                yield event
            if u.finished:
                if failed(u.finished):
                    yield {"type": "error", "error": {"type": "api_error",
                                                      "message": u.finished.error or "generation failed"}}
                    return
                stop_reason, stop_sequence = _stop(u.finished, chat)
                yield {"type": "message_delta",
                       "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                       "usage": _usage(chat, u.finished), "closed": u.finished.outputs[0].closed}
                yield {"type": "message_stop"}

    return await respond(chat.run, body.stream, events, whole, disconnected, typed_events=True)


async def count_tokens(s: ServerState, body: CountTokensRequest) -> dict:
    """The prompt tokens /v1/messages would send the model for this body."""
    s.check_model(body.model)
    params = SamplingParams(max_tokens=s.max_model_len)
    plan = await plan_chat(s, body.conversation(), body.chat_options(s.tool_grammar),
                           params, False, tools=body.tools, output_config=body.output_config)
    return {"input_tokens": len(plan.prompt_ids)}

