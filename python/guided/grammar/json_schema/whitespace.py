"""The whitespace policy: which whitespace runs a JSON grammar allows between tokens.

The default (``whitespace=None``) allows, between any two JSON tokens, at most one
whitespace run of either up to 8 spaces/tabs, or one newline (optionally ``\\r\\n``)
followed by up to 32 spaces/tabs of indentation. Compact JSON and
``json.dumps(obj, indent=2 or 4)`` are accepted; blank lines and long runs are not,
so a model that likes newlines cannot pad a value until max_tokens.
"""
from __future__ import annotations

from typing import Any


#: the default whitespace run between JSON tokens (see the module docstring)
# 32, not more: each tab is a token of its own, so the bound is also how many
# tokens a whitespace-loving model can spend per position.
BOUNDED_WHITESPACE = r"[\x20\x09]{1,8}|\r?\n[\x20\x09]{0,32}"


def whitespace_options(whitespace: str | None = None) -> dict:
    """llguidance JSON options (``x-guidance``) for a whitespace policy."""
    opts: dict[str, Any] = {"item_separator": ",", "key_separator": ":", "lenient": False,
                            "coerce_one_of": False}
    if whitespace is None or whitespace == "bounded":
        opts.update(whitespace_flexible=False, whitespace_pattern=BOUNDED_WHITESPACE)
    elif whitespace == "compact":
        opts.update(whitespace_flexible=False)
    elif whitespace == "flexible":
        opts.update(whitespace_flexible=True)
    elif isinstance(whitespace, str) and whitespace:
        opts.update(whitespace_flexible=False, whitespace_pattern=whitespace)
    else:
        raise ValueError(f"whitespace must be 'compact', 'flexible' or a regex, not {whitespace!r}")
    return opts
