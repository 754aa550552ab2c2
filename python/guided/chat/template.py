"""Render a model's own Jinja chat template the way transformers does.

Sandboxed (templates ship inside model files and are untrusted), with the
same whitespace options and helpers (`raise_exception`, `strftime_now`,
`tojson`) that templates written for transformers expect. Unlike
transformers' immutable sandbox, a template may change lists and dicts
(`list.append`, as Kimi K2 Thinking's does, and as llama.cpp renders it):
it gets its own copy of everything it is given, so it can change nothing
outside its render.
"""
from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping, Sized
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import SandboxedEnvironment


class TemplateError(ValueError):
    """The chat template refused the conversation or is broken."""


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys, default=_as_list)


def _as_list(value):
    """What Jinja's lazy filters (`map`, `select`, `selectattr`, ...) give is
    a list to the template's author, as in llama.cpp's renderer: `tools |
    map(attribute='function') | tojson` (DeepSeek R1 as llama.cpp ships it)."""
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping)):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _length(value) -> int:
    """`length`/`count` of a lazy filter's result, as of a list."""
    return len(value) if isinstance(value, Sized) else sum(1 for _ in value)


class _GenerationBlock(Extension):
    """transformers' ``{% generation %}…{% endgeneration %}`` (it marks the
    assistant's text for training masks, LFM2.5): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@lru_cache(maxsize=64)   # a template's compile is 0.1 s; the test matrix has 46 of them
def _compile(source: str) -> jinja2.Template:
    env = SandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.filters["length"] = env.filters["count"] = _length
    env.filters["fromjson"] = json.loads   # as llama.cpp's minja (StepFun's string arguments)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(template: str | None, messages: list[dict], *,
                add_generation_prompt: bool = True, **kwargs) -> str:
    """The prompt text for `messages`, ending where the assistant starts.

    ``kwargs`` become template variables, as transformers passes them:
    ``tools``, ``documents``, ``bos_token``/``eos_token`` and any
    ``chat_template_kwargs`` (``enable_thinking``, ``reasoning_effort``, ...).
    """
    if not template:
        raise TemplateError("the model has no chat template; use generate() with a prompt")
    if not messages:
        raise TemplateError("messages is empty")
    try:
        compiled = _compile(template)
    except jinja2.TemplateError as exc:
        raise TemplateError(f"chat template does not compile: {exc}") from exc
    try:
        return compiled.render(messages=copy.deepcopy(messages),
                               add_generation_prompt=add_generation_prompt, **copy.deepcopy(kwargs))
    except TemplateError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template is untrusted code: any failure is its own
        raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
