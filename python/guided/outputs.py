"""What generate() and chat() hand back, in vLLM's shape: a RequestOutput
per prompt (or conversation) holding ``n`` CompletionOutputs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Logprob:
    """One token's log-probability among a step's alternatives (vLLM's
    shape). rank: 1 for the most likely; None where the sampled token was
    not among the alternatives asked for."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a prompt.

    finish_reason: "stop" (end token, stop token or stop string), "length"
    (max_tokens or the context is full), "error" (see ``error``), and from
    chat, "tool_calls" when the model called tools. stop_reason: the stop
    string or stop token id that ended it; None for the model's end tokens,
    length and errors (as vLLM). token_ids include the end token that
    stopped generation; text never shows it.

    With SamplingParams.logprobs set, logprobs holds per token a dict
    {token_id: Logprob} of the most likely alternatives and the sampled
    token, and cumulative_logprob their sum over the sampled tokens (both
    None otherwise, as vLLM). Tokens the grammar forced have log-probability 0.

    From chat, the message parsed in the model's own format: content,
    reasoning_content and tool_calls (OpenAI's shape; arguments a JSON
    string); ``message()`` is what a client sends back next turn.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    error: str | None = None
    #: of token_ids, how many the grammar forced (appended without sampling)
    num_forced_tokens: int = 0
    #: the budget's closing wrote the end of this output (SamplingParams'
    #: structured_outputs "on_length"): the structure is whole, a value may
    #: be short; finish_reason is "stop" (or "length" with "close_as_length")
    closed: bool = False
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def message(self) -> dict[str, Any]:
        """The assistant message in OpenAI's shape (chat outputs)."""
        m: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content:
            m["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        return m


@dataclass
class RequestOutput:
    """A prompt's finished samples (``outputs``, one per SamplingParams.n).

    num_cached_tokens counts prompt tokens served from the prefix cache.
    ``text``, ``token_ids``, ``finish_reason``, ``error`` and
    ``num_forced_tokens`` are the first sample's, for scripts written
    before ``outputs`` existed.
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = True

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def error(self) -> str | None:
        return self.outputs[0].error

    @property
    def num_forced_tokens(self) -> int:
        return self.outputs[0].num_forced_tokens
