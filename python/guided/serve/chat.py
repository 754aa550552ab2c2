"""The chat core every chat-shaped API shares (/v1/chat/completions,
/v1/responses, /v1/messages): one conversation in OpenAI's message shape
and ChatOptions in, checked and planned by the chat layer, run as n
choices, and read back as the parser's deltas. Each API only translates
its body into that and the deltas into its own events.

Also POST /v1/chat/completions itself: everything the chat layer offers
(tools, reasoning, response_format, structured_outputs), n choices,
logprobs."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, NamedTuple

from ..chat import ChatOptions
from ..chat.parser import ChatDelta, ChatParser, ChatResponse
from ..chat.request import ChatPlan
from ..engine import StepUpdate
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .logprobs import chat_entries, ranked
from .protocol import ChatCompletionRequest
from .runs import Job, Run
from .state import ServerState, respond, usage


class Usage(NamedTuple):
    """A chat request's token counts; ``reasoning``: the generated tokens
    the parsers routed into reasoning blocks (the engine's own tokens, no
    re-encoding of the text), part of ``completion``."""

    prompt: int
    completion: int
    cached: int
    reasoning: int


@dataclass
class ChatRun:
    """One chat request in the engine: its n choices and their parsers."""

    run: Run
    prompt_ids: list[int]
    parsers: list[ChatParser]

    async def deltas(self) -> AsyncIterator[tuple[int, StepUpdate, list[ChatDelta]]]:
        """(choice, update, the parser's deltas for it) as tokens arrive;
        a choice's last update carries the deltas held back until its end."""
        async for i, u in self.run.updates():
            parser = self.parsers[i]
            yield i, u, parser.push(u.token_ids) + (parser.finish() if u.finished else [])

    def whole(self, i: int, out: RequestOutput) -> list[ChatDelta]:
        """Choice ``i``'s deltas at once, for an answer sent as one body (the
        parser then holds the whole message: ``parsers[i].result(out)``)."""
        return self.parsers[i].push(out.token_ids) + self.parsers[i].finish()

    def result(self, i: int, out: RequestOutput) -> ChatResponse:
        """Choice ``i``'s whole message (for an answer sent as one body)."""
        self.parsers[i].push(out.token_ids)
        return self.parsers[i].result(out)

    def usage(self, outs: list[RequestOutput]) -> Usage:
        """The token counts of the request's choices ``outs`` (those the
        parsers have read whole)."""
        return Usage(len(self.prompt_ids), sum(len(o.token_ids) for o in outs),
                     outs[0].num_cached_tokens if outs else 0,
                     sum(p.reasoning_tokens for p in self.parsers[:len(outs)]))


async def plan_chat(s: ServerState, messages: list[dict], options: ChatOptions,
                    params: SamplingParams, max_tokens_given: bool, **sizes) -> ChatPlan:
    """The chat layer's plan of one request, off the event loop, with the
    server's limits applied: ``sizes`` are the client's schemas and
    grammars (--max-grammar-bytes); ``params.max_tokens`` is the client's
    or, where it gave none (``max_tokens_given`` False), the context
    length, cut to what the prompt leaves once it is known."""
    s.policy.check_size(**sizes)
    plan = await s.policy.compile(s.llm.prepare_chat, messages, params, options, s.timed_compile)
    s.check_context(len(plan.prompt_ids), params.max_tokens if max_tokens_given else None)
    if not max_tokens_given:
        plan.params = replace(plan.params, max_tokens=s.max_model_len - len(plan.prompt_ids))
    return plan


async def open_chat(s: ServerState, plan: ChatPlan, n: int, endpoint: str, prefix: str) -> ChatRun:
    """``plan`` run as ``n`` choices (sample i draws from seed + i)."""
    plans = [replace(plan, params=plan.params.sample(j)) for j in range(n)]
    run = s.new_run(endpoint, prefix)
    await run.open([Job(plan.prompt_ids, p.params, p.grammar) for p in plans])
    return ChatRun(run, plan.prompt_ids, [p.parser() for p in plans])


def sampling_params(body, s: ServerState) -> tuple[SamplingParams, bool]:
    """``body``'s params (an OpenAI-shaped body, see protocol._Common), with
    the context length standing for a max_tokens it did not give."""
    given = body.requested_max_tokens()
    return body.sampling_params(given or s.max_model_len), given is not None


async def chat_completion_plan(s: ServerState, body: ChatCompletionRequest) -> ChatPlan:
    s.check_model(body.model)
    messages = [m.as_template_input() for m in body.messages]
    so = s.policy.structured_outputs(body.structured_outputs)
    options = body.chat_options(so, tool_grammar=s.tool_grammar)
    params, given = sampling_params(body, s)
    return await plan_chat(s, messages, options, params, given, tools=body.tools,
                           response_format=body.response_format, structured_outputs=so)


async def create_chat_completion(s: ServerState, body: ChatCompletionRequest,
                                 disconnected=None):
    plan = await chat_completion_plan(s, body)
    n = body.n
    chat = await open_chat(s, plan, n, "chat", "chatcmpl-")
    head = {"id": chat.run.request_id, "created": int(time.time()),
            "model": body.model or s.model_names[0]}
    wants_logprobs = body.logprobs

    def total_usage(outs) -> dict:
        return usage(*chat.usage(outs))

    def whole(outs) -> dict:
        choices = []
        for i, out in enumerate(outs):
            reply = chat.result(i, out)
            lp = {"content": chat_entries(s.texts, out.token_ids, *ranked(out.outputs[0])),
                  "refusal": None} if wants_logprobs else None
            choices.append({"index": i, "message": reply.message(), "logprobs": lp,
                            "finish_reason": reply.finish_reason, "closed": out.outputs[0].closed})
        return {**head, "object": "chat.completion", "choices": choices,
                "usage": total_usage(outs)}

    async def chunks():
        chunk = {**head, "object": "chat.completion.chunk"}

        def one(i: int, delta: dict, finish=None, lp=None, closed=None) -> dict:
            c = {"index": i, "delta": delta, "finish_reason": finish}
            if closed is not None:
                c["closed"] = closed
            if lp is not None:
                c["logprobs"] = {"content": lp, "refusal": None}
            return {**chunk, "choices": [c]}

        for i in range(n):
            yield one(i, {"role": "assistant", "content": ""})
        pending = [[] for _ in range(n)]   # logprobs waiting for a chunk to ride on
        finals = [None] * n
        async for i, u, deltas in chat.deltas():
            if wants_logprobs:
                pending[i] += chat_entries(s.texts, u.token_ids, u.logprobs, u.top_logprobs)
            for d in deltas:
                lp, pending[i] = (pending[i], []) if wants_logprobs else (None, [])
                yield one(i, _delta(d), lp=lp)
            if u.finished:
                finals[i] = u.finished
                lp = pending[i] if wants_logprobs else None
                yield one(i, {}, chat.parsers[i].finish_reason(u.finished), lp,
                          u.finished.outputs[0].closed)
        if body.include_usage:
            yield {**chunk, "choices": [], "usage": total_usage(finals)}

    return await respond(chat.run, body.stream, chunks, whole, disconnected)


def _delta(d: ChatDelta) -> dict:
    return {k: v for k, v in (("content", d.content), ("reasoning_content", d.reasoning_content),
                              ("tool_calls", d.tool_calls)) if v}
