"""Per-request generation settings, checked where they enter."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .grammar import ON_LENGTH


@dataclass
class StructuredOutputsParams:
    """vLLM's constraint object, accepted wherever a ``structured_outputs``
    dict is (see :mod:`guided.grammar` for each field). Exactly one of json,
    regex, choice, grammar, json_object (any JSON object) or structural_tag.
    vLLM's disable_any_whitespace is ``whitespace="compact"`` and its
    whitespace_pattern a regex for ``whitespace``."""

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    whitespace: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    on_length: str | None = None
    allow_special_tokens: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The ``structured_outputs`` dict this stands for."""
        given = {k: v for k, v in asdict(self).items()
                 if v is not None and (k == "json" or v is not False)}
        for vllm_name, value in (("disable_any_whitespace", "compact"),
                                 ("whitespace_pattern", self.whitespace_pattern)):
            if vllm_name in given:
                if "whitespace" in given:
                    raise ValueError(f"structured_outputs: give whitespace or {vllm_name}, not both")
                given.pop(vllm_name)
                given["whitespace"] = value
        return given


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop.

    temperature 0 is greedy. Penalties follow OpenAI (presence/frequency, over
    generated tokens) and HF (repetition, over prompt and generated tokens).
    Generation stops at any of the model's end tokens (unless ignore_eos), at
    any of `stop_token_ids`, at the first occurrence of a `stop` string (which
    is cut from the text) or after `max_tokens`.

    structured_outputs constrains the output to a grammar (see
    guided.grammar): {"json": schema} (optionally with "whitespace"),
    {"regex": ...}, {"choice": [...]}, {"grammar": lark_text} or
    {"json_object": True}, or the same as a StructuredOutputsParams. Under a
    grammar the grammar decides where the output ends (min_tokens does not
    hold end tokens back) and the text it forces is appended without
    sampling unless fast_forward is False (same tokens, one step each).
    logit_bias maps token ids to a bias in [-100, 100] added to their logits
    before temperature (OpenAI semantics); a grammar mask still wins.
    logprobs (0-20) asks for each output token's log-probability and that
    many most likely alternatives (RequestOutput.top_logprobs), under the
    distribution after penalties, logit_bias and the grammar mask, before
    temperature and top-k/top-p/min-p: greedy output is always the first
    alternative. Tokens a grammar forced have log-probability 0.
    n samples are drawn for each prompt, sharing its KV blocks; with a
    seed, sample i draws from seed + i, so they differ yet repeat.
    speculative turns speculative decoding on or off for this request (None:
    as the engine is set, EngineConfig.speculative): tokens looked up in
    the prompt and output so far, chosen by the grammar, are checked in one
    forward pass; the output is the same token for token. A request asking
    for logprobs does not speculate.
    on_length ("close", "close_as_length" or "cut"; None: as the
    constraint says, "close" by default) says what a constrained output
    does at its budget (see guided.grammar), whatever the constraint:
    a response_format, tools, a reasoning block.
    """

    max_tokens: int = 64
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    structured_outputs: dict[str, Any] | StructuredOutputsParams | None = None
    fast_forward: bool = True
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    speculative: bool | None = None
    on_length: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if isinstance(self.structured_outputs, StructuredOutputsParams):
            self.structured_outputs = self.structured_outputs.to_dict()
        if self.logit_bias:
            try:
                self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise ValueError("logit_bias must map token ids to numbers") from None
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range."""
        checks = [
            (isinstance(self.n, int) and self.n >= 1, f"n must be an int >= 1, got {self.n!r}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (all(isinstance(s, str) and s for s in self.stop),
             "stop must be a list of non-empty strings"),
            (self.seed is None or isinstance(self.seed, int), f"seed must be an int, got {self.seed!r}"),
        ]
        bias = self.logit_bias or {}
        checks += [
            (all(t >= 0 for t in bias), "logit_bias token ids must be >= 0"),
            (all(math.isfinite(b) and -100 <= b <= 100 for b in bias.values()),
             "logit_bias values must be in [-100, 100]"),
            (isinstance(self.fast_forward, bool), "fast_forward must be a bool"),
            (self.speculative is None or isinstance(self.speculative, bool),
             f"speculative must be a bool or None, got {self.speculative!r}"),
            (self.on_length in (None, *ON_LENGTH),
             f"on_length must be one of {', '.join(ON_LENGTH)}, got {self.on_length!r}"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             f"logprobs must be None or an int in [0, 20], got {self.logprobs!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.structured_outputs is not None:
            from .grammar import check_structured_outputs
            check_structured_outputs(self.structured_outputs)

    def sample(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of ``n`` (one engine request each)."""
        if self.n == 1 and index == 0:
            return self
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)
