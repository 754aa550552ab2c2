"""OpenAI request bodies, and how each maps onto SamplingParams.

Fields a client may send that we do not implement yet are refused with a 400
that names them, rather than silently changing what the client asked for.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..sampling_params import SamplingParams


class Unsupported(ValueError):
    """A request field that is valid OpenAI but not implemented here yet."""


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logprobs: Any = None
    user: str | None = None
    # extensions (vLLM's names)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    stop_token_ids: list[int] = Field(default_factory=list)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.n != 1:
            raise Unsupported("n: only n=1 is supported")
        if self.logprobs not in (None, False):
            raise Unsupported("logprobs are not supported yet")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=self._max_tokens() or default_max_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=stop,
            stop_token_ids=self.stop_token_ids, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos)

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    best_of: int | None = None

    def check(self) -> None:
        if self.echo:
            raise Unsupported("echo is not supported")
        if self.best_of not in (None, 1):
            raise Unsupported("best_of is not supported")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise Unsupported("prompt: send one prompt per request")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def as_template_input(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # text parts only
            if any(part.get("type") != "text" for part in self.content):
                raise Unsupported("messages: only text content parts are supported")
            message["content"] = "".join(part.get("text", "") for part in self.content)
        return message


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def chat_options(self) -> dict[str, Any]:
        """The fields the chat layer checks and plans (LLM.prepare_chat)."""
        return {"tools": self.tools, "tool_choice": self.tool_choice or "auto",
                "parallel_tool_calls": self.parallel_tool_calls,
                "response_format": self.response_format, "reasoning_effort": self.reasoning_effort,
                "chat_template_kwargs": self.chat_template_kwargs}

    def check(self) -> None:
        pass
