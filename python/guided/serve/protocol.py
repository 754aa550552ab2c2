"""OpenAI request bodies, and how each maps onto SamplingParams.

Pydantic checks types and ranges where a body enters; what needs the model
(prompt length, schemas, templates) is checked by the handlers. Fields a
client may send that we do not implement are refused with a 400 that names
them, rather than silently changing what the client asked for.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..chat import ChatOptions
from ..sampling_params import SamplingParams
from .errors import APIError

#: The most choices one request may ask for (each is a sequence in the engine).
MAX_N = 16
#: The most top alternatives per token (OpenAI's limit for chat).
MAX_TOP_LOGPROBS = 20


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[int, float] | None = None
    user: str | None = None
    # extensions (vLLM's names)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    stop_token_ids: list[int] = Field(default_factory=list)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    structured_outputs: dict[str, Any] | None = None
    # guided's own: speculative decoding for this request (None: as the server is set)
    speculative: bool | None = None
    # guided's own: what a constrained answer does at max_tokens ("close",
    # "close_as_length" or "cut"; None: as the constraint says)
    on_length: str | None = None

    def sampling_params(self, default_max_tokens: int, choice: int = 0) -> SamplingParams:
        """The engine's params for choice ``choice`` of ``n``: with a seed,
        choice i draws from seed + i, so the n samples differ yet repeat."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = None if self.seed is None else self.seed + choice
        try:
            return SamplingParams(
                max_tokens=self.requested_max_tokens() or default_max_tokens,
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                min_p=self.min_p, seed=seed, stop=stop, stop_token_ids=self.stop_token_ids,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos, logit_bias=self.logit_bias,
                logprobs=self.top_logprobs_wanted(), speculative=self.speculative,
                on_length=self.on_length)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def top_logprobs_wanted(self) -> int | None:
        """None: no logprobs; else how many alternatives per token. Each
        endpoint reads its own field (chat: logprobs + top_logprobs)."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """Each prompt as text or token ids; a 400 names an empty one."""
        p = self.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts:
            raise APIError(400, "prompt is empty", param="prompt")
        for i, one in enumerate(prompts):
            if not one:
                raise APIError(400, f"prompt[{i}] is empty", param="prompt")
        return prompts

    def check(self) -> None:
        if self.best_of not in (None, 1) and self.best_of != self.n:
            raise APIError(400, "best_of is not supported (use n)", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported: prompt logprobs are not "
                                "computed", param="echo")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def as_template_input(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # text parts only
            if any(part.get("type") != "text" for part in self.content):
                raise APIError(400, "messages: only text content parts are supported",
                               param="messages")
            message["content"] = "".join(part.get("text", "") for part in self.content)
        return message


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True      # vLLM's extra fields
    continue_final_message: bool = False

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def top_logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_options(self, structured_outputs: dict[str, Any] | None,
                     tool_grammar: bool) -> ChatOptions:
        """The fields the chat layer checks and plans (LLM.prepare_chat), with
        ``structured_outputs`` as the server's policy let it through."""
        return ChatOptions(tools=self.tools, tool_choice=self.tool_choice or "auto",
                           parallel_tool_calls=self.parallel_tool_calls,
                           response_format=self.response_format,
                           structured_outputs=structured_outputs,
                           reasoning_effort=self.reasoning_effort,
                           chat_template_kwargs=self.chat_template_kwargs, tool_grammar=tool_grammar,
                           add_generation_prompt=self.add_generation_prompt,
                           continue_final_message=self.continue_final_message)


class GrammarSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["lark", "regex", "json_schema", "choice"]
    content: str | list[str] | dict[str, Any] | bool

    def structured_outputs(self) -> dict[str, Any]:
        key = {"lark": "grammar", "regex": "regex", "json_schema": "json", "choice": "choice"}
        return {key[self.type]: self.content}


class GrammarRequest(_Common):
    """POST /v1/grammar: a raw constraint over a prompt (a completion) or
    messages (a chat answer)."""

    grammar: GrammarSpec
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = Field(default=256, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def as_request(self) -> CompletionRequest | ChatCompletionRequest:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        fields = self.model_dump(exclude={"grammar", "prompt", "messages", "logprobs"},
                                 exclude_none=True)
        fields["structured_outputs"] = self.grammar.structured_outputs()
        try:
            if self.prompt is not None:
                return CompletionRequest(prompt=self.prompt, logprobs=self.logprobs, **fields)
            return ChatCompletionRequest(messages=self.messages, logprobs=self.logprobs is not None,
                                         top_logprobs=self.logprobs, **fields)
        except ValidationError as exc:  # e.g. an empty messages list
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or None
            raise APIError(400, f"{where or 'body'}: {first['msg']}", param=where) from None
