"""The step loop: schedule → masks → forward → sample → update.

One engine step crosses into Rust four times in all (schedule, start_masks,
sample, update), whatever the batch size; where the model runner samples on
the GPU, device_rows stands for sample (model/device_sampler.py). Grammar
masks are computed on Rust threads while a GPU's forward pass runs, and
sample() joins them; on a CPU, whose cores the forward pass needs, mostly
only where the drawn token needs one (EngineConfig.masks). Python keeps only
what runs once per token per request and needs text: detokenizing and stop
strings.
"""
from __future__ import annotations

import collections
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from . import _native
from .model import LoadedModel, ModelRunner
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams
from .step_cost import StepCost
from .tokenizer import IncrementalDetokenizer, SpecialTokens, TokenizerWrapper, token_bytes

log = logging.getLogger("guided.engine")
class RequestGrammar(Protocol):
    """A request's grammar, composed where the request entered
    (``guided.grammar.ComposedGrammar``): llguidance TopLevelGrammar JSON
    text, what an output that reaches its budget does ("close",
    "close_as_length" or "cut"), and where a reasoning block must end
    (its end token and the output length by which it comes), if anywhere."""

    @property
    def text(self) -> str: ...

    @property
    def on_length(self) -> str: ...

    @property
    def reasoning_end(self) -> tuple[int, int] | None: ...


@dataclass
class EngineConfig:
    max_num_seqs: int = 64
    kv_cache_tokens: int | None = None
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    #: Speculative decoding for requests that do not say (SamplingParams.speculative):
    #: drafts looked up in each sequence's own tokens, chosen by its grammar, at most
    #: num_speculative_tokens a step (rust/engine/speculative.rs). ``drafter`` is "lookup",
    #: or "random:SEED" (drafts the grammar mostly refuses: for tests of the checking).
    speculative: bool = False
    num_speculative_tokens: int = 8
    drafter: str = "lookup"
    #: On a CPU: "auto" runs each step as native code (model/native.py) for a GGUF kept in its
    #: blocks (the default), "native" for any model it can run (an error says why not),
    #: "torch" runs decoder.py (the reference).
    cpu_step: str = "auto"
    #: Decode steps as CUDA graphs per batch-size bucket: "auto" (on CUDA where our kernels run),
    #: "off", or "padded" (the buckets without capture: model/decode_graphs.py).
    cuda_graphs: str = "auto"
    #: Grammar masks: "overlap" computes each constrained row's while the forward pass runs;
    #: "on_demand" only where the grammar refuses the token drawn without it (the same tokens:
    #: rust/engine/masks.rs); "auto": on_demand where the forward pass runs on the CPU.
    masks: str = "auto"

    def __post_init__(self):
        if self.masks not in (policies := ("auto", "overlap", "on_demand")):   # before any load
            raise ValueError(f"masks must be one of {', '.join(map(repr, policies))}, got {self.masks!r}")

    def model_len(self, mc) -> int:
        """The longest sequence served: max_model_len, within the model's positions."""
        return min(self.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)


@dataclass
class _Request:
    id: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    #: per output token, when params.logprobs asks for them
    top_logprobs: list[list[tuple[int, float]]] | None = None
    emitted: int = 0  # characters of detok.text already handed out as deltas
    forced_start: list[int] = field(default_factory=list)  # forced before the first step
    num_forced: int = 0
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    closed: bool = False  # the budget's closing wrote its end (CompletionOutput.closed)


@dataclass
class StepUpdate:
    """What one step did for one request: its new token, the text that became
    final, and the finished output when it ended."""

    request_id: int
    text: str
    token_id: int | None
    finished: RequestOutput | None
    #: every token appended this step: the sampled one and those forced after it
    token_ids: list[int] = field(default_factory=list)
    #: their log-probabilities, and top alternatives when the request asked
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig,
                 special: SpecialTokens | None = None, tokenizer: TokenizerWrapper | None = None):
        """`tokenizer`: a wrapper of the model's tokenizer to share (LLM's), else one is made."""
        self.loaded = loaded
        self.config = config
        self.special = special or SpecialTokens.classify(loaded.tokenizer, loaded.end_token_ids,
                                                         loaded.bos_token)
        self.tokenizer = tokenizer.with_special(self.special) if tokenizer else \
            TokenizerWrapper(loaded.tokenizer, self.special, loaded.add_bos_token)
        self.max_model_len = config.model_len(loaded.config)
        self.runner = ModelRunner(loaded, config.block_size, config.kv_cache_tokens,
                                  config.max_num_seqs, self.max_model_len, config.cpu_step, config.cuda_graphs)
        #: a state per sequence (Mamba-2, DeltaNet): prefix-cache hits only at its snapshots, a refused
        #: draft rolled back to the state after the last token kept (StatePool.drafted)
        self.recurrent = self.runner.states is not None
        if self.recurrent and config.enable_prefix_caching:
            log.info("prefix-cache hits for this model start at its state snapshots only (the block "
                     "boundary before an ended request's last token, and its prompt's)")
        self.scheduler = _native.Scheduler(
            num_blocks=self.runner.num_blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
            max_model_len=self.max_model_len, eos_token_ids=sorted(self.special.end_ids),
            enable_prefix_caching=config.enable_prefix_caching, speculative=config.speculative,
            num_speculative_tokens=config.num_speculative_tokens, drafter=config.drafter,
            masks=("on_demand" if loaded.device.type == "cpu" else "overlap") if config.masks == "auto"
            else config.masks)
        self.step_cost = StepCost()
        self.requests: dict[int, _Request] = {}
        self._ids = itertools.count()
        self._compiler: _native.GrammarCompiler | None = None
        # Requests that ended before reaching the scheduler (a grammar that
        # does not compile): reported by the next step().
        self._pending: list[StepUpdate] = []
        self.counters = {"prompt_tokens": 0, "generated_tokens": 0,
                         "steps": 0, "requests_finished": 0, "requests_failed": 0,
                         "closed_outputs": 0,
                         # host time in the scheduler's add_request and update,
                         # and the closing's time of finished requests
                         "add_request_us": 0, "update_us": 0, "closing_us": 0}
        #: per finished closing request, the microseconds its closing took
        #: (the latest ones: benches read percentiles from it)
        self.closing_times: collections.deque[int] = collections.deque(maxlen=4096)
        blocks = self.runner.num_blocks
        log.info("KV cache on %s: %d blocks of %d tokens (%d tokens), max_model_len %d",
                 loaded.device, blocks, config.block_size, blocks * config.block_size,
                 self.max_model_len)

    # -- grammars --------------------------------------------------------

    @property
    def grammar_compiler(self) -> _native.GrammarCompiler:
        """The model's grammar compiler, built on first use (one per model)."""
        if self._compiler is None:
            hf = self.loaded.tokenizer
            self._compiler = _native.GrammarCompiler(
                token_bytes(hf), sorted(self.special.grammar_end_ids),
                vocab_size=max(self.loaded.config.vocab_size, self.tokenizer.vocab_size),
                tokenize=self.tokenizer.encode_text)   # plain text's tokens, no BOS, no added token
        return self._compiler

    # -- requests --------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    grammar: RequestGrammar | None = None, *, prompt: str | None = None,
                    error: str | None = None) -> int:
        """Queue one request; raises ValueError (and queues nothing) on bad input.

        ``grammar`` is the request's one composed grammar, or None for free
        text: the places where requests enter (LLM.generate, LLM.chat, the
        server) compose ``params.structured_outputs``, tools and reasoning
        into it. A grammar that does not compile is not bad input of the
        call: that request alone ends at the next step with finish_reason
        "error", as does one given an ``error`` (its constraint failed to
        compose where it entered). One whose shortest complete output
        cannot fit in max_tokens, when closing, raises ValueError."""
        if grammar is None and error is None and params.structured_outputs is not None:
            raise ValueError("params.structured_outputs is not composed: compose it where the "
                             "request enters (guided.grammar.compose) and pass it as grammar")
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if any(not 0 <= t < self.tokenizer.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must lie in [0, {self.tokenizer.vocab_size})")
        vocab = self.loaded.config.vocab_size
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must lie in [0, {vocab})")
        rid = next(self._ids)
        req = _Request(rid, prompt, list(prompt_ids), params,
                       IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
                       top_logprobs=[] if params.logprobs is not None else None)
        compiled = None
        if grammar is not None and error is None:
            try:
                compiled = self.grammar_compiler.compile(grammar.text)
            except ValueError as exc:
                error = str(exc)
        if error is not None:
            self.requests[rid] = req
            self.counters["prompt_tokens"] += len(prompt_ids)
            done = self._finish(req, "error", 0, f"invalid grammar: {error}")
            self._pending.append(StepUpdate(rid, "", None, done))
            return rid
        on_length = params.on_length or (grammar.on_length if grammar is not None else "cut")
        started = time.perf_counter()
        forced = self.scheduler.add_request(
            rid, prompt_ids, params, compiled,
            close_on_length=compiled is not None and on_length != "cut",
            closed_as_length=compiled is not None and on_length == "close_as_length",
            reasoning_end=grammar.reasoning_end if compiled is not None else None)
        self.counters["add_request_us"] += int((time.perf_counter() - started) * 1e6)
        self.requests[rid] = req
        if self.recurrent:   # a hit only where a state snapshot is (and it is promised to this request)
            snapshot = self.runner.states.hit(rid, prompt_ids) if self.config.enable_prefix_caching else 0
            self.scheduler.limit_prefix(rid, snapshot)
        self._push_forced(req, forced)
        self.counters["prompt_tokens"] += len(prompt_ids)
        if forced:  # reported with the first step's tokens
            req.forced_start = list(forced)
        return rid

    def abort(self, rid: int) -> None:
        self.scheduler.abort(rid)
        self.requests.pop(rid, None)
        self.runner.release(rid)
        self._pending = [u for u in self._pending if u.request_id != rid]

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished()

    # -- the step --------------------------------------------------------

    def step(self) -> list[StepUpdate]:
        """Run one engine step; one update per request that got a token (or failed)."""
        pending, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        if plan is None:
            return pending
        self.counters["steps"] += 1
        self.scheduler.start_masks()  # masks beside the forward pass (rule 10), or before it on a CPU
        started = time.perf_counter()
        try:
            logits = self.runner.execute(plan)
        except Exception as exc:  # one bad step must not take the engine down (rule 12)
            log.exception("forward pass failed")
            return pending + self._fail(plan.seq_ids.tolist(), f"forward pass failed: {exc}")
        if logits is None:
            return pending
        forward = time.perf_counter() - started
        tokens, logprobs, tops = self.runner.sample(self.scheduler, logits)
        draws: dict = {}   # a sequence's first row (one with a draft has more)
        for sid, draw in zip(plan.sample_seq_ids.tolist(), zip(logprobs.tolist(), tops)):
            draws.setdefault(sid, draw)
        committed = time.perf_counter()
        events = self.scheduler.update(tokens)
        self.counters["update_us"] += int((time.perf_counter() - committed) * 1e6)
        updates = self._apply(events, draws)
        cost = self.step_cost.add(plan.num_tokens, forward, time.perf_counter() - started)
        if cost is not None:
            self.scheduler.set_step_cost(*cost)
        return pending + updates

    def _apply(self, events: list[_native.StepOutput], draws: dict) -> list[StepUpdate]:
        """``draws``: seq id → (logprob, top logprobs or None) of its sampled token."""
        updates = []
        for ev in events:
            req, token, reason = self.requests[ev.seq_id], ev.token, ev.finish_reason
            if token < 0:  # nothing allowed or rejected: never an arbitrary token (rule 9)
                updates.append(StepUpdate(req.id, "", None, self._finish(
                    req, "error", ev.num_cached_tokens,
                    ev.error or "no token was allowed at this point")))
                continue
            lp, top = draws[req.id]
            if top is not None:  # the client's view: before temperature and filters
                lp, top = top
            start = len(req.output_ids) - len(req.forced_start)
            # The sampled token, then those the grammar forced (probability 1),
            # then what later draws of a speculative step appended (a request
            # that asks for logprobs never speculates).
            new = [token, *ev.forced, *ev.more]
            self._append(req, token, lp, top)
            for t in new[1:]:
                self._append(req, t, 0.0)
            req.num_forced += len(ev.forced) + ev.more_forced
            req.closed = ev.closed
            if ev.closing_us:
                self.counters["closing_us"] += ev.closing_us
                self.closing_times.append(ev.closing_us)
            self.counters["generated_tokens"] += len(new)
            for t in new[:-1]:
                req.detok.push(t)
            # The token that stopped generation is control, never text (rule 1).
            if not (reason == "stop" and new[-1] in self._stoppers(req)):
                req.detok.push(new[-1])
            elif new[-1] in req.params.stop_token_ids:
                req.stop_reason = new[-1]
            # (a step that ended it may have written one too: forced tokens, a closing)
            if reason != "error" and self._cut_at_stop_string(req):
                if reason is None:
                    self.scheduler.abort(req.id)
                reason = "stop"
            req.forced_start = []
            if reason == "error":
                update = StepUpdate(req.id, "", token,
                                    self._finish(req, reason, ev.num_cached_tokens, ev.error))
            else:
                update = self._update(req, token, reason, ev.num_cached_tokens)
            self._fill_tokens(update, req, start)
            updates.append(update)
        return updates

    def _append(self, req: _Request, token: int, logprob: float, top=None) -> None:
        req.output_ids.append(token)
        req.logprobs.append(logprob)
        if req.top_logprobs is not None:
            req.top_logprobs.append(list(top) if top is not None else [(token, logprob)])

    @staticmethod
    def _fill_tokens(update: StepUpdate, req: _Request, start: int) -> None:
        """The tokens appended since ``start`` (forced-at-start ones included)."""
        update.token_ids = req.output_ids[start:]
        update.logprobs = req.logprobs[start:]
        if req.top_logprobs is not None:
            update.top_logprobs = req.top_logprobs[start:]

    def _push_forced(self, req: _Request, forced: list[int]) -> None:
        """Tokens the grammar forces before anything is sampled."""
        for t in forced:
            self._append(req, t, 0.0)
            req.detok.push(t)
        req.num_forced += len(forced)
        self.counters["generated_tokens"] += len(forced)

    def _stoppers(self, req: _Request) -> frozenset[int]:
        if req.params.ignore_eos:
            return frozenset(req.params.stop_token_ids)
        return self.special.end_ids | frozenset(req.params.stop_token_ids)

    def _cut_at_stop_string(self, req: _Request) -> bool:
        """True (and the text cut before it) when a stop string has appeared."""
        stops = req.params.stop
        if not stops:
            return False
        text = req.detok.text
        start = max(0, req.emitted - max(map(len, stops)))
        hits = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
        if hits:
            at, req.stop_reason = min(hits)
            req.detok.text = text[:at]
        return bool(hits)

    def _update(self, req: _Request, token: int, reason: str | None,
                num_cached: int) -> StepUpdate:
        """The text that became final this step. While a stop string could
        still be completing, its possible beginning is held back."""
        text = req.detok.text
        end = len(text)
        if reason is None and req.params.stop:
            end = max(req.emitted, end - max(map(len, req.params.stop)) + 1)
        delta, req.emitted = text[req.emitted:end], end
        done = self._finish(req, reason, num_cached) if reason is not None else None
        return StepUpdate(req.id, delta, token, done)

    def _finish(self, req: _Request, reason: str, num_cached: int,
                error: str | None = None) -> RequestOutput:
        self.requests.pop(req.id, None)
        self.runner.release(req.id, req.prompt_ids + req.output_ids)
        key = "requests_failed" if reason == "error" else "requests_finished"
        self.counters[key] += 1
        self.counters["closed_outputs"] += req.closed
        logprobs = self._vllm_logprobs(req) if req.top_logprobs is not None else None
        sample = CompletionOutput(
            index=0, text=req.detok.text, token_ids=req.output_ids,
            cumulative_logprob=sum(req.logprobs) if logprobs is not None else None,
            logprobs=logprobs, finish_reason=reason,
            stop_reason=req.stop_reason if reason == "stop" else None, error=error,
            num_forced_tokens=req.num_forced, closed=req.closed)
        return RequestOutput(request_id=req.id, prompt=req.prompt,
                             prompt_token_ids=req.prompt_ids, outputs=[sample],
                             num_cached_tokens=num_cached)

    def _vllm_logprobs(self, req: _Request) -> list[dict[int, Logprob]]:
        """Per token, {token_id: Logprob} of the alternatives asked for and
        the sampled token (vLLM's shape)."""
        decoded: dict[int, str] = {}

        def text(t: int) -> str:
            if t not in decoded:
                decoded[t] = self.tokenizer.decode([t], skip_special_tokens=False)
            return decoded[t]

        out = []
        for token, lp, tops in zip(req.output_ids, req.logprobs, req.top_logprobs or []):
            step = {a: Logprob(alp, rank, text(a)) for rank, (a, alp) in enumerate(tops, 1)}
            step.setdefault(token, Logprob(lp, None, text(token)))
            out.append(step)
        return out

    def _fail(self, rids: list[int], message: str) -> list[StepUpdate]:
        out = []
        for rid in rids:
            self.scheduler.abort(rid)
            if rid in self.requests:
                done = self._finish(self.requests[rid], "error", 0, message)
                out.append(StepUpdate(rid, "", None, done))
        return out

    def fail_all(self, message: str) -> list[StepUpdate]:
        """End every queued or running request with finish_reason "error"."""
        pending, self._pending = self._pending, []
        return pending + self._fail(list(self.requests), message)

    def stats(self) -> dict[str, int]:
        return {**self.counters, **self.scheduler.stats()}

    # -- the prefix cache's changes (for a cache-aware router) ---------------

    def record_cache_events(self) -> None:
        """Keep what enters and leaves the prefix cache from now on, for take_cache_events()."""
        self.scheduler.record_cache_events()

    def take_cache_events(self) -> list[tuple[bool, int, int | None, list[int]]]:
        """The prefix cache's changes since the last call, oldest first (once
        record_cache_events() was called): per full block stored ``(True,
        hash, parent hash or None, token ids)``, per block evicted ``(False,
        hash, None, [])``."""
        return self.scheduler.take_cache_events()
