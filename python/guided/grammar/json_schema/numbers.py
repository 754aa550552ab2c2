"""Number spellings llguidance's JSON compiler leaves out, as JSON Schema counts them.

JSON Schema compares numbers by value: ``1e-06`` is a number above 0, ``2.0`` equals the enum
value ``2``. llguidance writes a number with bounds without an exponent, and an enum's integral
number as digits only. The writer adds these spellings beside its leaf, each a regex whose every
match has a value the schema accepts:

* ``{"type": "number"}`` with a minimum at or below 0 (or exclusiveMinimum at or below 0, and no
  maximum): non-negative (positive) numbers in exponent form; mirrored for a maximum at or above 0;
* an enum's (or const's) integral number ``n``: also ``n.0``.

Left out on purpose: ``2.0`` for ``{"type": "integer"}``. It is an integer to JSON Schema, but a
small model given the choice writes ``21.0000000000000000``, and typed clients parse integers
strictly (pydantic in strict mode, openai-agents' output_type: "Invalid JSON"). Other bounds keep
llguidance's spelling only (a subset, as before).
"""
from __future__ import annotations

from typing import Any

_BOUNDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
_DIGITS = r"(?:0|[1-9][0-9]*)"
_NONZERO = r"(?:[1-9][0-9]*(?:\.[0-9]+)?|0\.[0-9]*[1-9][0-9]*)"   # a mantissa above 0
_MANTISSA = rf"{_DIGITS}(?:\.[0-9]+)?"
_EXPONENT = r"[eE][+-]?[0-9]+"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _signs(node: dict) -> tuple[bool, bool, bool] | None:
    """(every negative, zero, every positive value meets the bounds); None on a bound that is
    not a number. A sign the bounds cut into gets no added spelling."""
    neg = zero = pos = True
    for kw in _BOUNDS & set(node):
        v = node[kw]
        if not _is_number(v):
            return None
        if kw in ("minimum", "exclusiveMinimum"):
            neg = False
            if v > 0 or (v == 0 and kw == "exclusiveMinimum"):
                zero = False
            if v > 0:
                pos = False
        else:
            pos = False
            if v < 0 or (v == 0 and kw == "exclusiveMaximum"):
                zero = False
            if v < 0:
                neg = False
    return neg, zero, pos


def number_forms(node: dict) -> list[str]:
    """Regexes (Lark ``/.../`` bodies) for node's values spelled in a way llguidance's leaf does
    not take; [] when there are none to add."""
    keys = set(node) - {"type"}
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types or [])
    if keys <= {"enum"} and isinstance(node.get("enum"), list):
        out = []
        for v in node["enum"]:
            if _is_number(v) and float(v).is_integer() and abs(v) < 1e15 and \
                    (not types or types & {"integer", "number"}):
                out.append(("-" if v < 0 else "") + str(abs(int(v))) + r"\.0")
        return out
    if not keys <= _BOUNDS or not types or not types <= {"integer", "number"}:
        return []
    signs = _signs(node)
    if signs is None:
        return []
    if "number" not in types or not keys:
        return []       # integers: digits only (see above); an unbounded number has the exponent
    forms = (rf"{_NONZERO}{_EXPONENT}", rf"-?0(?:\.0+)?{_EXPONENT}", rf"-{_NONZERO}{_EXPONENT}")
    return [form for form, sign in zip(forms, (signs[2], signs[1], signs[0])) if sign]
