"""What generate() and chat() hand back."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """One finished completion.

    finish_reason: "stop" (end token, stop token or stop string), "length"
    (max_tokens or the context is full) or "error" (see `error`).
    token_ids include the end token that stopped generation; text never shows
    it. num_cached_tokens counts prompt tokens served from the prefix cache.
    logprobs holds each token's log-probability; with
    SamplingParams.logprobs set, top_logprobs holds, per token, the most
    likely [(token_id, logprob)] (see SamplingParams).
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int = 0
    error: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    #: of token_ids, how many the grammar forced (appended without sampling)
    num_forced_tokens: int = 0
