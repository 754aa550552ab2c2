"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions,
/v1/models, /health and /metrics."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import replace
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest

from ..chat.parser import ChatDelta
from ..engine import StepUpdate
from ..llm import LLM
from .async_engine import AsyncEngine
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest, Unsupported


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={
        "error": {"message": message, "type": kind, "param": param, "code": None}})


def create_app(llm: LLM, model_name: str, api_key: str | None = None,
               enable_tool_grammar: bool = False) -> FastAPI:
    """``enable_tool_grammar``: enforce the tool-call grammar for
    tool_choice="auto" too (DESIGN rule 8); "required" and a named tool are
    always enforced."""
    app = FastAPI(title="guided")
    engine = AsyncEngine(llm.engine)
    metrics = Metrics(lambda: engine.stats)
    tokenizer = llm.tokenizer
    max_model_len = llm.engine.max_model_len
    app.state.engine = engine

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return error_response(401, "missing or wrong API key", "authentication_error")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}",
                              param=where)

    @app.exception_handler(Unsupported)
    async def unsupported(_request: Request, exc: Unsupported):
        return error_response(400, str(exc))

    @app.on_event("shutdown")
    def stop_engine() -> None:
        engine.shutdown()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "guided",
                                            "max_model_len": max_model_len}]}

    async def start(prompt_ids: list[int], params, grammar=None
                    ) -> tuple[AsyncIterator[StepUpdate], StepUpdate]:
        """Submit, and wait for the first update so refusals become a 400."""
        stream = engine.generate(prompt_ids, params, grammar)
        first = await stream.__anext__()
        return stream, first

    async def run(endpoint: str, prompt_ids, params, stream_body, full_body, grammar=None):
        began = time.perf_counter()
        try:
            stream, first = await start(prompt_ids, params, grammar)
        except ValueError as exc:
            return error_response(400, str(exc))
        metrics.ttft.observe(time.perf_counter() - began)

        def finished(update: StepUpdate) -> None:
            metrics.latency.observe(time.perf_counter() - began)
            metrics.requests.labels(endpoint, update.finished.finish_reason).inc()

        async def updates():
            yield first
            async for update in stream:
                yield update

        if stream_body is not None:
            async def body():
                try:
                    async for event in sse(stream_body(updates(), finished)):
                        yield event
                finally:  # runs on client disconnect too: aborts the request at once
                    await stream.aclose()
            return StreamingResponse(body(), media_type="text/event-stream")
        last = first
        async for update in updates():
            last = update
        finished(last)
        return full_body(last.finished)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        body.check()
        prompt = body.prompt[0] if isinstance(body.prompt, list) and body.prompt \
            and isinstance(body.prompt[0], str) else body.prompt
        if not prompt:
            return error_response(400, "prompt is empty", param="prompt")
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = body.sampling_params(default_max_tokens=16)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}

        def full(out):
            return {**head, "choices": [{"index": 0, "text": out.text, "logprobs": None,
                                         "finish_reason": out.finish_reason}],
                    "usage": usage(len(ids), len(out.token_ids))}

        async def chunks(updates, finished):
            async for u in updates:
                reason = u.finished.finish_reason if u.finished else None
                if u.text or reason:
                    yield {**head, "choices": [{"index": 0, "text": u.text, "logprobs": None,
                                                "finish_reason": reason}]}
                if u.finished:
                    finished(u)
                    if body.include_usage:
                        yield {**head, "choices": [],
                               "usage": usage(len(ids), len(u.finished.token_ids))}

        return await run("completions", ids, params, chunks if body.stream else None, full)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        body.check()
        messages = [m.as_template_input() for m in body.messages]
        try:  # templates and grammar checks are CPU work: off the event loop
            plan = await asyncio.to_thread(llm.prepare_chat, messages, None,
                                           tool_grammar=enable_tool_grammar, **body.chat_options())
        except ValueError as exc:
            return error_response(400, str(exc), param="messages")
        ids = plan.prompt_ids
        params = body.sampling_params(default_max_tokens=max(1, max_model_len - len(ids)))
        plan = replace(plan, params=params)
        parser = plan.parser()
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": created, "model": model_name}

        def reason(out) -> str:
            return "tool_calls" if out.finish_reason == "stop" and parser.call_ids else out.finish_reason

        def full(out):
            parser.push(out.token_ids)
            result = parser.result()
            message = {"role": "assistant", "content": result.content}
            if result.reasoning_content is not None:
                message["reasoning_content"] = result.reasoning_content
            if result.tool_calls:
                message["tool_calls"] = result.tool_calls
            return {**head, "object": "chat.completion",
                    "choices": [{"index": 0, "message": message, "logprobs": None,
                                 "finish_reason": reason(out)}],
                    "usage": usage(len(ids), len(out.token_ids), out.num_cached_tokens)}

        def delta_chunk(chunk: dict, d: ChatDelta) -> dict:
            delta = {k: v for k, v in (("content", d.content), ("reasoning_content", d.reasoning_content),
                                       ("tool_calls", d.tool_calls)) if v}
            return {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}

        async def chunks(updates, finished):
            chunk = {**head, "object": "chat.completion.chunk"}
            yield {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]}
            async for u in updates:
                deltas = parser.push(u.token_ids) + (parser.finish() if u.finished else [])
                for d in deltas:
                    yield delta_chunk(chunk, d)
                if u.finished:
                    finished(u)
                    yield {**chunk, "choices": [{"index": 0, "delta": {},
                                                 "finish_reason": reason(u.finished)}]}
                    if body.include_usage:
                        out = u.finished
                        yield {**chunk, "choices": [],
                               "usage": usage(len(ids), len(out.token_ids), out.num_cached_tokens)}

        return await run("chat", ids, params, chunks if body.stream else None, full, plan.grammar)

    return app


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


async def sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    async for chunk in chunks:
        yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"
