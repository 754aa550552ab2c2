"""What every handler shares: the model, the engine thread, limits, metrics,
and the checks that every endpoint applies the same way."""
from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from fastapi.responses import StreamingResponse

from ..grammar import ComposedGrammar, compose
from ..llm import LLM
from .admission import Admission, ConstraintPolicy, TimedCompile
from .async_engine import AsyncEngine
from .errors import APIError
from .logprobs import TokenTexts
from .metrics import Metrics
from .runs import Run


@dataclass
class ServerState:
    llm: LLM
    engine: AsyncEngine
    metrics: Metrics
    admission: Admission
    policy: ConstraintPolicy
    model_names: list[str]
    tool_grammar: bool = True
    texts: TokenTexts = field(init=False)
    timed_compile: TimedCompile = field(init=False)

    def __post_init__(self) -> None:
        self.texts = TokenTexts(self.llm.loaded.tokenizer)
        self.timed_compile = TimedCompile(self.llm.engine.grammar_compiler.compile,
                                          self.metrics.grammar_compile.observe)

    @property
    def max_model_len(self) -> int:
        return self.llm.engine.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"{', '.join(self.model_names)}", param="model",
                           code="model_not_found")

    def check_context(self, prompt_tokens: int, max_tokens: int | None, where: str = "") -> None:
        limit = self.max_model_len
        if prompt_tokens >= limit:
            raise APIError(400, f"{where}the prompt has {prompt_tokens} tokens; this model's context "
                                f"length is {limit} tokens", param="messages")
        if max_tokens is not None and prompt_tokens + max_tokens > limit:
            raise APIError(400, f"{where}max_tokens={max_tokens} with a {prompt_tokens}-token prompt "
                                f"exceeds this model's context length of {limit} tokens",
                           param="max_tokens")

    async def constraint_grammar(self, so: dict | None) -> ComposedGrammar | None:
        """``structured_outputs`` (already allowed by the policy) composed and
        compiled off the event loop; the engine's compile of the same text
        is then a cache hit."""
        if so is None:
            return None

        def build() -> ComposedGrammar:
            try:
                grammar = compose(so)
                self.timed_compile(grammar.text)
            except ValueError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
            return grammar
        return await self.policy.compile(build)

    def new_run(self, endpoint: str, prefix: str) -> Run:
        """A run whose request id is ``prefix`` and a random hex (with the
        separator the API's own ids use: "chatcmpl-…", "resp_…")."""
        return Run(self.engine, self.admission, self.metrics, endpoint,
                   f"{prefix}{uuid.uuid4().hex}")


def rendered(s: ServerState, prefix: str, model: str | None, token_ids: list[int]) -> dict:
    """A render endpoint's answer (vLLM's shape): the prompt's token ids,
    which a cache-aware router such as vllm-router matches between
    requests."""
    return {"request_id": f"{prefix}{uuid.uuid4().hex}", "model": model or s.model_names[0],
            "token_ids": list(token_ids)}


async def respond(run: Run, stream: bool, chunks: Callable[[], AsyncIterator[dict]],
                  whole: Callable[[list], dict],
                  disconnected: Callable[[], Awaitable[bool]] | None = None,
                  typed_events: bool = False):
    """Server-sent events or one JSON body; either way the run is closed (and
    what is left of it aborted) when the response ends or the client leaves
    (``disconnected`` tells, for a client waiting for one JSON body).
    ``typed_events``: each event named by its chunk's "type" and no [DONE]
    at the end (the Responses and Messages APIs); else chat completions'
    plain data lines ending with [DONE]."""
    if stream:
        async def body():
            try:
                async for chunk in chunks():
                    data = json.dumps(chunk, ensure_ascii=False)
                    yield f"event: {chunk['type']}\ndata: {data}\n\n" if typed_events \
                        else f"data: {data}\n\n"
                if not typed_events:
                    yield "data: [DONE]\n\n"
            finally:
                await run.close()
        return StreamingResponse(body(), media_type="text/event-stream")
    try:
        outs = await _unless_gone(run.finals(), disconnected)
    finally:
        await run.close()
    return whole(outs)


async def _unless_gone(work: Awaitable, disconnected, every: float = 0.5):
    """``work``'s result, or a 499 once the client has gone (no one reads it)."""
    task = asyncio.ensure_future(work)
    if disconnected is None:
        return await task
    while True:
        done, _ = await asyncio.wait({task}, timeout=every)
        if done:
            return task.result()
        if await disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise APIError(499, "the client closed the request")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage object; ``reasoning_tokens`` (chat only) goes in
    completion_tokens_details, as OpenAI reports it."""
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens,
         "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return u
