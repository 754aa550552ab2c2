"""Schema algebra on plain JSON values: canonical values, JSON types, anyOf/allOf that simplify."""
from __future__ import annotations

import json
from typing import Any

from .vocabulary import KEYWORDS_BY_TYPE, TYPES


def canon(v: Any) -> str:
    """A canonical key for a JSON value (1 and 1.0 are the same number)."""
    def norm(x):
        if isinstance(x, bool) or x is None or isinstance(x, str):
            return x
        if isinstance(x, float) and x.is_integer():
            return int(x)
        if isinstance(x, dict):
            return {k: norm(x[k]) for k in sorted(x)}
        if isinstance(x, list):
            return [norm(i) for i in x]
        return x
    return json.dumps(norm(v), sort_keys=True)


def json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def any_of(options: list) -> Any:
    """anyOf over options, simplified (True absorbs, False vanishes)."""
    opts = [o for o in options if o is not False and o != {"enum": []}]
    if any(o is True or o == {} for o in opts):
        return True
    if not opts:
        return False
    if len(opts) == 1:
        return opts[0]
    return {"anyOf": opts}


def all_of(options: list) -> Any:
    opts = [o for o in options if o is not True and o != {}]
    if any(o is False for o in opts):
        return False
    if not opts:
        return True
    if len(opts) == 1:
        return opts[0]
    return {"allOf": opts}


def as_schema(x: Any) -> Any:
    """Booleans as schemas llguidance takes everywhere."""
    if x is True:
        return {}
    if x is False:
        return False
    return x


def type_set(t: Any) -> set[str]:
    """The types a "type" keyword names (number includes integer)."""
    ts = set(t) if isinstance(t, list) else {t}
    if "number" in ts:
        ts.add("integer")
    return ts


def node_types(node: dict) -> set[str]:
    """The types a schema's "type" allows (all of them when absent; number includes integer)."""
    t = node.get("type", list(TYPES))
    ts = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set(TYPES)
    if "number" in ts:
        ts.add("integer")
    return ts


def relevant(node: dict) -> dict:
    """node without unknown keywords and those for types its "type" rules out."""
    types = node_types(node) | {"any"}
    if "integer" in types:
        types.add("number")
    return {k: v for k, v in node.items()
            if any(k in KEYWORDS_BY_TYPE[t] for t in types if t in KEYWORDS_BY_TYPE)}
