"""Complements: a schema for (a subset of) the instances that break a schema, by De Morgan
over its keywords. Parts with no expressible complement (patterns, multipleOf, ...) are
left out, which only narrows the result."""
from __future__ import annotations

import math
from typing import Any

from .algebra import all_of, any_of, json_type, type_set
from .analysis import MAX_DEPTH
from .refs import Unsupported
from .regex import complement_strings_regex
from .vocabulary import ANNOTATIONS, TYPES


class Complement:
    """``neg(s)`` for the Sanitizer (uses its ``resolve``)."""

    def neg(self, s: Any, depth: int) -> Any:
        """A schema for a subset of the complement of s (None: nothing expressible)."""
        if depth > MAX_DEPTH:
            return None
        if s is True or s == {}:
            return False
        if s is False:
            return True
        if not isinstance(s, dict):
            return None
        if "$ref" in s:
            try:
                target = self.resolve(s["$ref"])
            except Unsupported:
                return None
            rest = {k: v for k, v in s.items() if k != "$ref"}
            parts = [self.neg(target, depth + 1)]
            if rest:
                parts.append(self.neg(rest, depth + 1))
            got = [p for p in parts if p is not None]
            return any_of(got) if got else None
        s = {k: v for k, v in s.items() if k not in ANNOTATIONS and k not in (
            "$schema", "$id", "id", "definitions", "$defs", "$anchor")}
        if not s:
            return False
        ts = type_set(s["type"]) if "type" in s else None
        parts: list = []  # each a schema for instances that break one conjunct
        complete = True

        def add(x):
            nonlocal complete
            if x is None:
                complete = False
            else:
                parts.append(x)

        if ts is not None:
            others = [t for t in TYPES if t not in ts]
            if "integer" in ts and "number" not in ts:
                others = [t for t in others if t != "number"]  # non-integral numbers: not expressible
                complete = False
            add({"type": others} if others else False)

        def typed(t: str, body: dict) -> dict | None:
            if ts is None or t in ts:
                return {"type": t, **body}
            if t == "number" and "integer" in ts:
                return {"type": "integer", **body}
            return None  # the keyword is vacuous for s's types: nothing to complement

        if "const" in s or "enum" in s:
            vals = [s["const"]] if "const" in s else list(s.get("enum") or [])
            add(self._neg_values(vals))
        if "minLength" in s and s["minLength"] > 0:
            add(typed("string", {"maxLength": int(math.ceil(s["minLength"])) - 1}))
        if "maxLength" in s:
            add(typed("string", {"minLength": int(math.floor(s["maxLength"])) + 1}))
        for k in ("pattern", "format"):
            if k in s:
                add(None)
        if "minimum" in s and isinstance(s["minimum"], (int, float)):
            if s.get("exclusiveMinimum") is True:
                add(typed("number", {"maximum": s["minimum"]}))
            else:
                add(typed("number", {"exclusiveMaximum": s["minimum"]}))
        if "maximum" in s and isinstance(s["maximum"], (int, float)):
            if s.get("exclusiveMaximum") is True:
                add(typed("number", {"minimum": s["maximum"]}))
            else:
                add(typed("number", {"exclusiveMinimum": s["maximum"]}))
        if isinstance(s.get("exclusiveMinimum"), (int, float)) and not isinstance(s.get("exclusiveMinimum"), bool):
            add(typed("number", {"maximum": s["exclusiveMinimum"]}))
        if isinstance(s.get("exclusiveMaximum"), (int, float)) and not isinstance(s.get("exclusiveMaximum"), bool):
            add(typed("number", {"minimum": s["exclusiveMaximum"]}))
        if "multipleOf" in s:
            add(None)
        if "minItems" in s and s["minItems"] > 0:
            add(typed("array", {"maxItems": int(s["minItems"]) - 1}))
        if "maxItems" in s:
            add(typed("array", {"minItems": int(s["maxItems"]) + 1}))
        if isinstance(s.get("items"), dict) and "prefixItems" not in s:
            # an array whose first item breaks 'items' (a subset of those with any such item)
            n = self.neg(s["items"], depth + 1)
            if n is not None and n is not False:
                add(typed("array", {"minItems": 1, "prefixItems": [n]}))
            else:
                add(None)
        for k in ("items", "prefixItems", "additionalItems", "contains", "uniqueItems"):
            if k == "items" and isinstance(s.get("items"), dict) and "prefixItems" not in s:
                continue
            if k in s and s[k] not in (True, {}, False) and not (k == "uniqueItems" and s[k] is False):
                add(None)
            elif k in ("items", "additionalItems") and s.get(k) is False:
                add(None)
        if isinstance(s.get("required"), list):
            for p in s["required"]:
                # non-objects satisfy 'required', so only objects can break it: an
                # untyped {"properties": {p: false}} would also admit every non-object
                if ts is None or "object" in ts:
                    add({"type": "object", "properties": {p: False}})
        if isinstance(s.get("properties"), dict):
            for p, sub in s["properties"].items():
                n = self.neg(sub, depth + 1)
                if n is None:
                    add(None)
                elif n is not False:
                    add(typed("object", {"required": [p], "properties": {p: n}}))
        for k in ("additionalProperties", "patternProperties", "propertyNames", "minProperties",
                  "maxProperties", "dependencies", "dependentRequired", "dependentSchemas",
                  "unevaluatedProperties", "unevaluatedItems", "if", "then", "else"):
            if k in s and s[k] not in (True, {}):
                add(None)
        if isinstance(s.get("anyOf"), list):
            negs = [self.neg(o, depth + 1) for o in s["anyOf"]]
            add(None if any(n is None for n in negs) else all_of(negs))
        if isinstance(s.get("oneOf"), list):
            # not exactly-one: none of them, or (not expressible) two or more
            negs = [self.neg(o, depth + 1) for o in s["oneOf"]]
            add(None if any(n is None for n in negs) else all_of(negs))
        if isinstance(s.get("allOf"), list):
            for o in s["allOf"]:
                add(self.neg(o, depth + 1))
        if "not" in s:
            add(s["not"])  # (sanitised schemas keep no 'not'; double negation is exact)
        if not parts:
            return None if not complete else False
        return any_of(parts)

    def _neg_values(self, vals: list) -> Any:
        """Instances not in a finite set of values (a subset when not expressible exactly)."""
        by_type: dict[str, list] = {}
        for v in vals:
            by_type.setdefault(json_type(v), []).append(v)
        out = []
        for t in ("null", "boolean", "string", "array", "object"):
            if t not in by_type:
                out.append({"type": t})
        nums = sorted({float(v) for v in by_type.get("integer", []) + by_type.get("number", [])})
        if not nums:
            out.append({"type": "number"})
        elif len(nums) <= 32:
            # every number outside the set lies in one of the open intervals between its values
            bounds = [None] + nums + [None]
            for lo, hi in zip(bounds, bounds[1:]):
                iv: dict = {"type": "number"}
                if lo is not None:
                    iv["exclusiveMinimum"] = int(lo) if lo.is_integer() else lo
                if hi is not None:
                    iv["exclusiveMaximum"] = int(hi) if hi.is_integer() else hi
                out.append(iv)
        if "boolean" in by_type:
            bs = {bool(v) for v in by_type["boolean"]}
            if len(bs) == 1:
                out.append({"const": not bs.pop()})
        if "string" in by_type:
            rx = complement_strings_regex([v for v in by_type["string"]])
            if rx is not None:
                out.append({"type": "string", "pattern": rx})
        return any_of(out)
