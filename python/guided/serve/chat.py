"""POST /v1/chat/completions: everything the chat layer offers (tools,
reasoning, response_format, structured_outputs), n choices, logprobs."""
from __future__ import annotations

import time
from dataclasses import replace

from ..chat.parser import ChatDelta
from .logprobs import chat_entries, ranked
from .protocol import ChatCompletionRequest
from .runs import Job
from .state import ServerState, respond, usage


async def create_chat_completion(s: ServerState, body: ChatCompletionRequest,
                                 disconnected=None):
    s.check_model(body.model)
    messages = [m.as_template_input() for m in body.messages]
    so = s.policy.structured_outputs(body.structured_outputs)
    s.policy.check_size(tools=body.tools, response_format=body.response_format,
                        structured_outputs=so)
    options = body.chat_options(so, tool_grammar=s.enable_tool_grammar)
    # Templates, schemas and grammar compiles are CPU work: off the event loop.
    plan = await s.policy.compile(s.llm.prepare_chat, messages, None, options, s.timed_compile)
    ids = plan.prompt_ids
    s.check_context(len(ids), body.requested_max_tokens())
    n = body.n
    default_max = s.max_model_len - len(ids)
    plans = [replace(plan, params=body.sampling_params(default_max, j)) for j in range(n)]
    parsers = [p.parser() for p in plans]
    run = s.new_run("chat", "chatcmpl")
    await run.open([Job(ids, p.params, p.grammar) for p in plans])
    head = {"id": run.request_id, "created": int(time.time()),
            "model": body.model or s.model_names[0]}
    wants_logprobs = body.logprobs

    def total_usage(outs) -> dict:
        return usage(len(ids), sum(len(o.token_ids) for o in outs), outs[0].num_cached_tokens)

    def whole(outs) -> dict:
        choices = []
        for i, out in enumerate(outs):
            parsers[i].push(out.token_ids)
            reply = parsers[i].result(out)
            lp = {"content": chat_entries(s.texts, out.token_ids, *ranked(out.outputs[0])),
                  "refusal": None} if wants_logprobs else None
            choices.append({"index": i, "message": reply.message(), "logprobs": lp,
                            "finish_reason": reply.finish_reason})
        return {**head, "object": "chat.completion", "choices": choices,
                "usage": total_usage(outs)}

    async def chunks():
        chunk = {**head, "object": "chat.completion.chunk"}

        def one(i: int, delta: dict, finish=None, lp=None) -> dict:
            c = {"index": i, "delta": delta, "finish_reason": finish}
            if lp is not None:
                c["logprobs"] = {"content": lp, "refusal": None}
            return {**chunk, "choices": [c]}

        for i in range(n):
            yield one(i, {"role": "assistant", "content": ""})
        pending = [[] for _ in range(n)]   # logprobs waiting for a chunk to ride on
        finals = [None] * n
        async for i, u in run.updates():
            if wants_logprobs:
                pending[i] += chat_entries(s.texts, u.token_ids, u.logprobs, u.top_logprobs)
            deltas = parsers[i].push(u.token_ids) + (parsers[i].finish() if u.finished else [])
            for d in deltas:
                lp, pending[i] = (pending[i], []) if wants_logprobs else (None, [])
                yield one(i, _delta(d), lp=lp)
            if u.finished:
                finals[i] = u.finished
                lp = pending[i] if wants_logprobs else None
                yield one(i, {}, parsers[i].finish_reason(u.finished), lp)
        if body.include_usage:
            yield {**chunk, "choices": [], "usage": total_usage(finals)}

    return await respond(run, body.stream, chunks, whole, disconnected)


def _delta(d: ChatDelta) -> dict:
    return {k: v for k, v in (("content", d.content), ("reasoning_content", d.reasoning_content),
                              ("tool_calls", d.tool_calls)) if v}
