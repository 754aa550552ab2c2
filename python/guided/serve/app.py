"""The HTTP API: OpenAI's /v1/completions, /v1/chat/completions and
/v1/responses, Anthropic's /v1/messages (and /v1/messages/count_tokens), our
/v1/grammar, vLLM's render endpoints (each of the three OpenAI paths plus
/render: the prompt's token ids, for cache-aware routers), and /v1/models,
/health and /metrics."""
from __future__ import annotations

import os
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import generate_latest

from ..llm import LLM
from ..models import lookup
from .admission import Admission, ConstraintPolicy
from .async_engine import AsyncEngine
from .chat import chat_completion_plan, create_chat_completion
from .completions import create_completion, render_completion
from .errors import APIError, error_response, install_handlers
from .messages import CountTokensRequest, MessagesRequest, count_tokens, create_message
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest, GrammarRequest
from .responses import ResponsesRequest, ResponseStore, create_response, response_plan
from .state import ServerState, rendered

DEFAULT_MAX_QUEUE = 1024


def served_names(given: list[str] | None, model: str | None, model_path: str) -> list[str]:
    """The model ids clients may send: those given (--served-model-name),
    else the model file's or directory's name, after ``model`` itself where
    it is a catalogue name rather than a path (``--model qwen2.5-coder-0.5b``)."""
    if given:
        return list(given)
    stem = Path(model_path).stem
    asked = model is not None and not os.path.exists(model) and lookup(model) is not None
    return [model, stem] if asked and model != stem else [stem]


_PATHS = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
          "/v1/grammar", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
          "/v1/completions/render", "/v1/chat/completions/render", "/v1/responses/render"}


class KeyAndCount:
    """Checks the API key on /v1 (``Authorization: Bearer KEY`` as OpenAI's
    clients send it, or ``x-api-key: KEY`` as Anthropic's) and counts
    responses by path and status. A plain ASGI middleware: it leaves the
    receive channel alone, so handlers still see a client disconnect."""

    def __init__(self, app, api_key: str | None, metrics: Metrics):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in _PATHS else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.responses.labels(path, str(message["status"])).inc()
            await send(message)

        if self.api_key and scope["path"].startswith("/v1/"):
            headers = dict(scope["headers"])
            bearer = headers.get(b"authorization", b"").decode("latin-1")
            key = headers.get(b"x-api-key", b"").decode("latin-1")
            if bearer != f"Bearer {self.api_key}" and key != self.api_key:
                return await error_response(401, "missing or wrong API key",
                                            path=scope["path"])(scope, receive, counted)
        await self.app(scope, receive, counted)



def create_app(llm: LLM, model_name: str | list[str], api_key: str | None = None,
               tool_grammar: bool = True, policy: ConstraintPolicy | None = None,
               max_queue: int = DEFAULT_MAX_QUEUE, kv_events=None,
               close_llm: bool = False) -> FastAPI:
    """``model_name``: the id(s) clients may send; ``tool_grammar``:
    enforce the tool-call grammar for tool_choice="auto" too (the default;
    "required", a named tool and "none" are always enforced); ``policy``: which
    client constraints are allowed and their limits; ``max_queue``: requests'
    sequences that may wait beyond the running ones before a 503;
    ``kv_events``: a ``kv_events.KvEventPublisher`` for the prefix cache's
    changes (closed with the app); ``close_llm``: the app's shutdown also
    closes ``llm`` (its tensor-parallel ranks), once the engine thread has
    stopped."""
    engine = AsyncEngine(llm.engine, kv_events)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            engine.shutdown()
            if kv_events is not None:
                kv_events.close()
            if close_llm:
                llm.close()

    app = FastAPI(title="guided", lifespan=lifespan)
    group = llm.loaded.tensor_group
    metrics = Metrics(lambda: engine.stats, group.rank_stats if group is not None else None)
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    s = ServerState(llm, engine, metrics,
                    Admission(llm.engine.config.max_num_seqs, max_queue),
                    policy or ConstraintPolicy(), names, tool_grammar)
    app.state.server = s
    install_handlers(app)

    app.add_middleware(KeyAndCount, api_key=api_key, metrics=metrics)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                            "owned_by": "guided", "max_model_len": s.max_model_len}
                                           for name in names]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(s, body, request.is_disconnected)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(s, body, request.is_disconnected)

    # The prompt a request renders to, as token ids, nothing generated (vLLM's
    # render endpoints): what a cache-aware router (vllm-router) matches.
    @app.post("/v1/completions/render")
    async def completions_render(body: CompletionRequest):
        return render_completion(s, body)

    @app.post("/v1/chat/completions/render")
    async def chat_completions_render(body: ChatCompletionRequest):
        plan = await chat_completion_plan(s, body)
        return rendered(s, "chatcmpl-", body.model, plan.prompt_ids)

    store = ResponseStore()

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await create_response(s, store, body, request.is_disconnected)

    @app.post("/v1/responses/render")
    async def responses_render(body: ResponsesRequest):
        plan, _ = await response_plan(s, store, body)
        return rendered(s, "resp_", body.model, plan.prompt_ids)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str):
        return store.get(response_id)[1]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        return await create_message(s, body, request.is_disconnected)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(body: CountTokensRequest):
        return await count_tokens(s, body)

    @app.post("/v1/grammar")
    async def grammar(body: GrammarRequest, request: Request):
        """A raw constraint over a prompt (answered as a completion) or
        messages (answered as a chat completion)."""
        if not s.policy.allow_constraint_api:
            raise APIError(400, "/v1/grammar needs a server started with --allow-constraint-api")
        inner = body.as_request()
        if isinstance(inner, CompletionRequest):
            return await create_completion(s, inner, request.is_disconnected)
        return await create_chat_completion(s, inner, request.is_disconnected)

    return app
