"""Token log-probabilities in OpenAI's two shapes: chat's
``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`` and the
legacy completions ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.

Control tokens (end of turn, tool-call markers, reasoning tags) are never
shown to a client (DESIGN rule 11), so they are left out of both, as
alternatives too.
"""
from __future__ import annotations

from ..tokenizer import token_bytes

_CONTROL = 0xFF  # token_bytes marks added tokens with this first byte


class TokenTexts:
    """Each token id's bytes and text, as a client sees it."""

    def __init__(self, hf_tokenizer):
        self.bytes = token_bytes(hf_tokenizer)

    def is_control(self, token: int) -> bool:
        b = self.bytes[token] if token < len(self.bytes) else b""
        return not b or b[0] == _CONTROL

    def text(self, token: int) -> str:
        return self.bytes[token].decode("utf-8", errors="replace")


def ranked(sample) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """A finished sample's logprobs (vLLM's shape: {token: Logprob} per
    token) as each token's logprob and its alternatives, most likely first."""
    logprobs, tops = [], []
    for token, step in zip(sample.token_ids, sample.logprobs or []):
        logprobs.append(step[token].logprob)
        tops.append([(t, lp.logprob) for t, lp in sorted(step.items(), key=lambda kv: kv[1].rank or 0)
                     if lp.rank is not None])
    return logprobs, tops


def chat_entries(texts: TokenTexts, tokens: list[int], logprobs: list[float],
                 tops: list | None) -> list[dict]:
    out = []
    for i, (t, lp) in enumerate(zip(tokens, logprobs)):
        if texts.is_control(t):
            continue
        alternatives = [_chat_one(texts, a, alp) for a, alp in (tops[i] if tops else [])
                        if not texts.is_control(a)]
        out.append({**_chat_one(texts, t, lp), "top_logprobs": alternatives})
    return out


def _chat_one(texts: TokenTexts, token: int, logprob: float) -> dict:
    return {"token": texts.text(token), "logprob": _finite(logprob),
            "bytes": list(texts.bytes[token])}


def completion_logprobs(texts: TokenTexts, tokens: list[int], logprobs: list[float],
                        tops: list | None, offset: int = 0) -> dict:
    """``offset``: where the first token's text starts in the choice's text."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, (t, lp) in enumerate(zip(tokens, logprobs)):
        if texts.is_control(t):
            continue
        text = texts.text(t)
        out["tokens"].append(text)
        out["token_logprobs"].append(_finite(lp))
        out["top_logprobs"].append({texts.text(a): _finite(alp) for a, alp in (tops[i] if tops else [])
                                    if not texts.is_control(a)})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _finite(lp: float) -> float:
    """JSON has no -inf; OpenAI writes a very small number instead."""
    return lp if lp > -9999.0 else -9999.0
