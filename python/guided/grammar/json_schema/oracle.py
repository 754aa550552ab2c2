"""What llguidance's own JSON compiler says of a schema: whether it has no instance.

The compiler decides emptiness where our analysis cannot (regex intersections, formats,
bounds), in well under a millisecond for a small schema. The writer asks it of each leaf (an
unsatisfiable option or property is dropped, as the compiler itself drops them), and the oneOf
rewrite asks whether two string options can overlap.
"""
from __future__ import annotations

import json
from typing import Any

import llguidance


def unsatisfiable(schema: Any) -> bool:
    """True only if llguidance's compiler proves ``schema`` (with its $defs) has no instance."""
    error = llguidance.LLMatcher.validate_grammar(json.dumps({"grammars": [{"json_schema": schema}]}))
    return error.startswith("Unsatisfiable schema")
