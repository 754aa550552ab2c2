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
