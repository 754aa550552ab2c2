"""Keyword value types: a malformed schema is a ValueError naming the keyword and its path,
not a TypeError from deep inside a rewrite."""
from __future__ import annotations

from typing import Any

from .vocabulary import TYPES

_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
           "minContains", "maxContains")
_NUMBERS = ("minimum", "maximum", "multipleOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMAS = ("not", "if", "then", "else", "contains", "propertyNames", "additionalProperties",
            "unevaluatedProperties", "unevaluatedItems")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_schema(v: Any) -> bool:
    return isinstance(v, (dict, bool))


def _fail(path: str, kw: str, want: str, v: Any):
    raise ValueError(f"invalid JSON schema at {path}: '{kw}' must be {want}, not {v!r}"[:300])


def check_keywords(node: dict, path: str) -> None:
    """Raise ValueError when a keyword's value has the wrong JSON type."""
    for kw in _COUNTS:
        if kw in node:
            v = node[kw]
            if not (_is_number(v) and v >= 0 and float(v).is_integer()):
                _fail(path, kw, "a non-negative integer", v)
    for kw in _NUMBERS:
        if kw in node and not _is_number(node[kw]):
            _fail(path, kw, "a number", node[kw])
    if "multipleOf" in node and node["multipleOf"] <= 0:
        _fail(path, "multipleOf", "a number above 0", node["multipleOf"])
    for kw in ("exclusiveMinimum", "exclusiveMaximum"):
        if kw in node and not (_is_number(node[kw]) or isinstance(node[kw], bool)):
            _fail(path, kw, "a number", node[kw])
    if "type" in node:
        t = node["type"]
        names = t if isinstance(t, list) else [t]
        if not names or not all(isinstance(n, str) and n in TYPES for n in names):
            _fail(path, "type", f"one of {list(TYPES)} or a list of them", t)
    if "enum" in node and not isinstance(node["enum"], list):
        _fail(path, "enum", "an array", node["enum"])
    if "pattern" in node and not isinstance(node["pattern"], str):
        _fail(path, "pattern", "a string", node["pattern"])
    if "required" in node:
        r = node["required"]
        if not (isinstance(r, list) and all(isinstance(n, str) for n in r)):
            _fail(path, "required", "an array of strings", r)
    for kw in _SCHEMA_MAPS:
        if kw in node and not (isinstance(node[kw], dict)
                               and all(_is_schema(v) for v in node[kw].values())):
            _fail(path, kw, "an object of schemas", node[kw])
    for kw in _SCHEMA_LISTS:
        if kw in node and not (isinstance(node[kw], list) and node[kw]
                               and all(_is_schema(v) for v in node[kw])):
            _fail(path, kw, "a non-empty array of schemas", node[kw])
    for kw in _SCHEMAS:
        if kw in node and not _is_schema(node[kw]):
            _fail(path, kw, "a schema (an object or a boolean)", node[kw])
    if "items" in node and not (_is_schema(node["items"]) or (
            isinstance(node["items"], list) and all(_is_schema(v) for v in node["items"]))):
        _fail(path, "items", "a schema or an array of schemas", node["items"])
    if "uniqueItems" in node and not isinstance(node["uniqueItems"], bool):
        _fail(path, "uniqueItems", "a boolean", node["uniqueItems"])
