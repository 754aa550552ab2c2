"""POST /v1/completions: one or more prompts, n choices each."""
from __future__ import annotations

import time

from .logprobs import completion_logprobs, ranked
from .protocol import CompletionRequest
from .runs import Job
from .state import ServerState, rendered, respond, usage

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def _encoded(s: ServerState, body: CompletionRequest) -> list[list[int]]:
    """Each prompt's token ids, checked against the context."""
    s.check_model(body.model)
    body.check()
    encoded = [s.llm.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in body.prompts()]
    for i, ids in enumerate(encoded):
        s.check_context(len(ids), body.requested_max_tokens(),
                        f"prompt[{i}]: " if len(encoded) > 1 else "")
    return encoded


def render_completion(s: ServerState, body: CompletionRequest) -> list[dict]:
    """/v1/completions/render: each prompt's token ids, nothing generated."""
    return [rendered(s, "cmpl-", body.model, ids) for ids in _encoded(s, body)]


async def create_completion(s: ServerState, body: CompletionRequest,
                            disconnected=None):
    encoded = _encoded(s, body)
    so = s.policy.structured_outputs(body.structured_outputs)
    s.policy.check_size(structured_outputs=so)
    prompts = body.prompts()
    grammar = await s.constraint_grammar(so)
    n = body.n
    jobs = [Job(ids, body.sampling_params(DEFAULT_MAX_TOKENS, j), grammar, group=p)
            for p, ids in enumerate(encoded) for j in range(n)]
    run = s.new_run("completions", "cmpl-")
    await run.open(jobs)
    echo = [(p if isinstance(p, str) else s.llm.tokenizer.decode(ids)) if body.echo else ""
            for p, ids in zip(prompts, encoded)]
    head = {"id": run.request_id, "object": "text_completion", "created": int(time.time()),
            "model": body.model or s.model_names[0]}
    wants_logprobs = body.logprobs is not None

    def total_usage(outs) -> dict:
        leaders = outs[::n]
        return usage(sum(len(ids) for ids in encoded), sum(len(o.token_ids) for o in outs),
                     sum(o.num_cached_tokens for o in leaders))

    def whole(outs) -> dict:
        choices = []
        for i, out in enumerate(outs):
            prefix = echo[i // n]
            lp = completion_logprobs(s.texts, out.token_ids, *ranked(out.outputs[0]),
                                     len(prefix)) if wants_logprobs else None
            choices.append({"index": i, "text": prefix + out.text, "logprobs": lp,
                            "finish_reason": out.finish_reason, "closed": out.outputs[0].closed})
        return {**head, "choices": choices, "usage": total_usage(outs)}

    async def chunks():
        offsets = [len(echo[i // n]) for i in range(len(jobs))]
        for i in range(len(jobs)):
            if echo[i // n]:
                yield {**head, "choices": [{"index": i, "text": echo[i // n], "logprobs": None,
                                            "finish_reason": None}]}
        finals = [None] * len(jobs)
        async for i, u in run.updates():
            reason = u.finished.finish_reason if u.finished else None
            lp = None
            if wants_logprobs:
                lp = completion_logprobs(s.texts, u.token_ids, u.logprobs, u.top_logprobs, offsets[i])
                offsets[i] += len(u.text)
            if u.text or reason or (lp and lp["tokens"]):
                choice = {"index": i, "text": u.text, "logprobs": lp, "finish_reason": reason}
                if u.finished:
                    choice["closed"] = u.finished.outputs[0].closed
                yield {**head, "choices": [choice]}
            if u.finished:
                finals[i] = u.finished
        if body.include_usage:
            yield {**head, "choices": [], "usage": total_usage(finals)}

    return await respond(run, body.stream, chunks, whole, disconnected)
