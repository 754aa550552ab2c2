"""OpenAI's strict mode (``"strict": true`` on a json_schema response_format,
and the default for a function tool's parameters unless it says ``"strict":
false``): an object that does not say otherwise takes no properties beyond
those it lists. Without strict, JSON Schema's own default holds (any other
property is allowed), and a small model that invents properties may spend
its budget inside one (or call a function with a keyword it does not take).

The rewrite only narrows: ``additionalProperties: false`` is added to each
object schema that has none of additionalProperties, patternProperties and
unevaluatedProperties. The direct parts of an ``allOf`` are left open (each
lists only some of the properties the whole object has, so closing them
would refuse every instance); their own sub-schemas are rewritten.
"""
from __future__ import annotations

from typing import Any

_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("anyOf", "oneOf", "prefixItems")
_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "contains", "not",
        "if", "then", "else", "propertyNames")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def strict_schema(schema: Any, *, in_all_of: bool = False) -> Any:
    """``schema`` with every object schema closed to unlisted properties."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in out[key].items()}
    for key in _LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(sub) for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [strict_schema(sub, in_all_of=True) for sub in out["allOf"]]
    for key in _ONE:
        sub = out.get(key)
        if isinstance(sub, list):   # draft 4 tuple items
            out[key] = [strict_schema(s) for s in sub]
        elif isinstance(sub, dict):
            out[key] = strict_schema(sub)
    if _is_object(out) and not in_all_of and "allOf" not in out and \
            not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def _is_object(schema: dict) -> bool:
    kind = schema.get("type")
    if kind is None:
        return "properties" in schema or "required" in schema
    return kind == "object" or (isinstance(kind, list) and "object" in kind)
