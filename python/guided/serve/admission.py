"""What the server accepts before any work starts: a bounded number of
sequences in flight, and constraints within the operator's limits.

The engine runs at most ``max_num_seqs`` sequences; beyond them requests
wait. ``--max-queue`` bounds that wait: a request whose choices would take
the total past ``max_num_seqs + max_queue`` gets a 503 with Retry-After at
once, instead of a timeout later.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..grammar import CONSTRAINT_KEYS, JSON_KEYS, special_token_refs
from .errors import APIError

RETRY_AFTER_SECONDS = 1


class Admission:
    def __init__(self, max_num_seqs: int, max_queue: int):
        self.capacity = max_num_seqs + max_queue
        self.in_flight = 0

    def acquire(self, n: int) -> None:
        if self.in_flight + n > self.capacity:
            raise APIError(503, f"the server is at capacity ({self.in_flight} sequences running "
                                f"or queued, at most {self.capacity}); retry shortly",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        self.in_flight += n

    def release(self, n: int) -> None:
        self.in_flight -= n


@dataclass
class ConstraintPolicy:
    """The operator's choices (DESIGN rule 8). JSON schemas (response_format,
    structured_outputs.json, tool parameters) are always allowed; raw
    grammars, regexes, choices and structural tags need
    ``allow_constraint_api``; special tokens in a client grammar need
    ``allow_special_tokens`` too."""

    allow_constraint_api: bool = False
    allow_special_tokens: bool = False
    max_grammar_bytes: int = 128 * 1024
    max_compile_seconds: float = 10.0

    def check_size(self, **parts: Any) -> None:
        """The client's schemas and grammars together, as JSON text."""
        size = sum(len(json.dumps(v, ensure_ascii=False)) for v in parts.values() if v is not None)
        if size > self.max_grammar_bytes:
            named = ", ".join(k for k, v in parts.items() if v is not None)
            raise APIError(400, f"{named}: the constraint is {size} bytes, over this server's limit "
                                f"of {self.max_grammar_bytes} (--max-grammar-bytes)", param=named)

    def structured_outputs(self, so: Any) -> dict | None:
        """``so`` as the grammar layer takes it, or a 400 that names the flag
        it needs."""
        if so is None:
            return None
        if not isinstance(so, dict):
            raise APIError(400, "structured_outputs must be an object", param="structured_outputs")
        raw = [k for k in CONSTRAINT_KEYS if k in so and k not in JSON_KEYS]
        if raw and not self.allow_constraint_api:
            raise APIError(400, f"structured_outputs.{raw[0]} needs a server started with "
                                "--allow-constraint-api (JSON schemas are always allowed)",
                           param="structured_outputs")
        so = dict(so)
        if "allow_special_tokens" in so:
            raise APIError(400, "structured_outputs.allow_special_tokens is the operator's choice: "
                                "start the server with --allow-grammar-special-tokens",
                           param="structured_outputs")
        named = special_token_refs(so["grammar"]) if isinstance(so.get("grammar"), str) else []
        if named and not self.allow_special_tokens:
            raise APIError(400, f"structured_outputs.grammar names special tokens "
                                f"({', '.join(named[:3])}); this server does not allow that "
                                "(--allow-grammar-special-tokens)", param="structured_outputs")
        if named:
            so["allow_special_tokens"] = True
        return so

    async def compile(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Run ``fn`` (template rendering, grammar composition and compiling)
        off the event loop, within the compile-time limit. ValueError → 400."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args, **kwargs),
                                          self.max_compile_seconds)
        except asyncio.TimeoutError:
            raise APIError(400, f"preparing the request's grammar took over "
                                f"{self.max_compile_seconds:g} s (--max-grammar-compile-seconds)"
                           ) from None
        except ValueError as exc:
            raise APIError(400, str(exc)) from None


class TimedCompile:
    """A grammar compiler's ``compile`` that reports how long each took."""

    def __init__(self, compile_fn: Callable[[str], Any], observe: Callable[[float], None]):
        self.compile_fn, self.observe = compile_fn, observe

    def __call__(self, grammar: str) -> Any:
        began = time.perf_counter()
        try:
            return self.compile_fn(grammar)
        finally:
            self.observe(time.perf_counter() - began)
