"""Intersections of plain schemas, for the writer: allOf (and anyOf or $ref beside other keywords)
as a union of plain schemas (``type``, object and array keywords, enum, string and number
keywords), which the writer then writes like any other.

Exact: an object's keys are constrained independently, so two objects meet key by key (a key
one part does not list meets that part's additionalProperties), arrays meet item by item, listed
values are filtered by a validator, and an anyOf part distributes over the rest. Two string or
number parts stay an allOf that llguidance intersects. Where a part is none of these, or the
distribution passes MAX_BRANCHES, ``union`` says None and the node goes to llguidance whole.

A oneOf rewritten with complements (one_of.py) meets many small anyOfs; three rules keep that
small: a branch inside one option of an anyOf stays as it is, branches equal but for one key's
value become one (_collapse), and property values meet as soon as both are plain (so a
discriminator that cannot match is False at once).
"""
from __future__ import annotations

import json
from typing import Any

import jsonschema
from referencing.exceptions import Unresolvable

from .algebra import all_of, any_of, canon, json_type, node_types, relevant
from .property_order import may_match
from .vocabulary import KEYWORDS_BY_TYPE, TYPES

_REF = "#/$defs/"
MAX_BRANCHES = 256   # anyOf branches one intersection may distribute into
MAX_DEPTH = 8        # nested anyOf/allOf/$ref a part is unfolded through
MAX_WORK = 20_000    # merges for one schema (then the rest goes to llguidance whole)
_PLAIN = {"type", "properties", "required", "additionalProperties", "items", "prefixItems",
          "minItems", "maxItems", "enum", "const"}
_APPLICATORS = {"allOf", "anyOf", "oneOf", "not", "if", "$ref"}
_SCALAR = KEYWORDS_BY_TYPE["string"] | KEYWORDS_BY_TYPE["number"]
_SCALAR_TYPES = {"null", "boolean", "integer", "number", "string"}
_OBJECT = ("properties", "required", "additionalProperties")
_ARRAY = ("items", "prefixItems", "minItems", "maxItems")
# patterns every name matches (so their schema is every key's: additionalProperties' role)
UNIVERSAL = ("", ".*", "^.*$", "^.*", ".*$", "^(.*)$")


class Intersection:
    """Intersections of the schemas in one schema's $defs."""

    def __init__(self, defs: dict):
        self.defs = defs
        self.work = 0   # merges so far (MAX_WORK bounds one schema's)

    def union(self, node: dict) -> list[dict] | None:
        """node as a union of plain schemas ([] when it has no instance); None where some part
        is not plain (llguidance takes it whole)."""
        parts = {json.dumps(p, sort_keys=True): p for p in _conjuncts(node)}
        # plain parts first, then anyOfs from the fewest options: most branches die at once
        ordered = sorted(parts.values(), key=lambda p: len(p["anyOf"]) if isinstance(p, dict) and
                         set(p) == {"anyOf"} and isinstance(p["anyOf"], list) else 0)
        branches: list[dict] = [{}]
        for part in ordered:
            options = self.options(part)
            if options is None:
                return None
            merged = []
            for b in branches:
                ms = [self.merge(b, o) for o in options]
                if any(m is None for m in ms):
                    return None
                ms = [m for m in ms if m is not False]
                # b inside one option: the anyOf adds nothing to b
                merged += [b] if any(m == b for m in ms) else ms
            branches = _collapse(merged)
            if len(branches) > MAX_BRANCHES:
                return None
        return branches

    def options(self, part: Any, depth: int = 0) -> list[dict] | None:
        """part as a union of plain schemas (None where it is not one)."""
        if part is True:
            return [{}]
        if part is False:
            return []
        if not isinstance(part, dict) or depth > MAX_DEPTH:
            return None
        part = relevant(plain_patterns(part))
        if set(part) <= _PLAIN:
            return _by_type(part)
        if not set(part) & _APPLICATORS and set(part) <= _PLAIN | _SCALAR:
            return [part]
        if set(part) <= {"type", "allOf"} | _SCALAR and node_types(part) <= _SCALAR_TYPES and \
                all(isinstance(p, dict) and set(p) <= _SCALAR for p in part.get("allOf", [])):
            return [part]   # string/number keywords met earlier
        if set(part) <= _PLAIN | {"minProperties"} and node_types(part) == {"object"}:
            room = [n for n, v in part.get("properties", {}).items() if v is not False]
            if part.get("additionalProperties", True) is False and part["minProperties"] > len(room):
                return []   # more properties than the object may have
        if set(part) == {"$ref"}:
            ref = part["$ref"]
            if not (isinstance(ref, str) and ref.startswith(_REF) and ref[len(_REF):] in self.defs):
                return None
            return self.options(self.defs[ref[len(_REF):]], depth + 1)
        if set(part) == {"anyOf"} and isinstance(part["anyOf"], list):
            out = []
            for o in part["anyOf"]:
                sub = self.options(o, depth + 1)
                if sub is None:
                    return None
                out += sub
            return out
        if "allOf" in part or "anyOf" in part or "$ref" in part:
            return self.union(part) if depth < MAX_DEPTH else None
        return None

    def meet(self, x: Any, y: Any, depth: int) -> Any:
        """Two property (or item) values' intersection: met where both are a few plain schemas
        (a discriminator that cannot match is False at once), else their allOf."""
        if x is True or x == {} or y is False:
            return y
        if y is True or y == {} or x is False or x == y:
            return x
        if depth < 3:
            ox, oy = self.options(x, MAX_DEPTH - 2), self.options(y, MAX_DEPTH - 2)
            if ox is not None and oy is not None and len(ox) * len(oy) <= MAX_BRANCHES:
                merged = [self.merge(a, b, depth + 1) for a in ox for b in oy]
                if all(m is not None for m in merged):
                    return any_of(_collapse([m for m in merged if m is not False]))
        return all_of([x, y])

    def merge(self, a: dict, b: dict, depth: int = 0) -> dict | bool | None:
        """The intersection of two plain schemas (False: none; None: not expressible here)."""
        self.work += 1
        if self.work > MAX_WORK:
            return None
        types = node_types(a) & node_types(b)
        if not types:
            return False
        a, b = _keep(a, types), _keep(b, types)
        if any(k in x for x in (a, b) for k in ("enum", "const")):
            return _merge_values(a, b, types)
        out: dict = {}
        if types != set(TYPES):
            out["type"] = _type_list(types)
        if set(a) - _PLAIN or set(b) - _PLAIN:
            # string or number keywords: an allOf of both (llguidance intersects them)
            if types & {"object", "array"} or any(set(x) - _PLAIN - _SCALAR - {"allOf"} for x in (a, b)):
                return None
            parts = [p for x in (a, b) for p in _scalar_parts(x)]
            return {**out, **parts[0]} if len(parts) == 1 else {**out, "allOf": parts}
        if "array" in types and any(k in x for x in (a, b) for k in _ARRAY):
            return self._arrays(a, b, out, depth) if types == {"array"} else None
        if "object" in types and any(k in x for x in (a, b) for k in _OBJECT):
            return self._objects(a, b, out, depth) if types == {"object"} else None
        return out

    def _arrays(self, a: dict, b: dict, out: dict, depth: int) -> dict | bool:
        ia, ib = a.get("items", True), b.get("items", True)
        pa, pb = a.get("prefixItems", []), b.get("prefixItems", [])
        prefix = [self.meet(pa[i] if i < len(pa) else ia, pb[i] if i < len(pb) else ib, depth)
                  for i in range(max(len(pa), len(pb)))]
        if prefix:
            out["prefixItems"] = prefix
        items = self.meet(ia, ib, depth)
        if items is not True:
            out["items"] = items
        lo = max(a.get("minItems", 0), b.get("minItems", 0))
        his = [x["maxItems"] for x in (a, b) if "maxItems" in x]
        if his and min(his) < lo:
            return False
        if lo:
            out["minItems"] = lo
        if his:
            out["maxItems"] = min(his)
        return out

    def _objects(self, a: dict, b: dict, out: dict, depth: int) -> dict | bool | None:
        pa, pb = a.get("properties", {}), b.get("properties", {})
        apa, apb = a.get("additionalProperties", True), b.get("additionalProperties", True)
        if not all(isinstance(x, dict) for x in (pa, pb)):
            return None
        props = {n: self.meet(pa.get(n, apa), pb.get(n, apb), depth)
                 for n in list(pa) + [n for n in pb if n not in pa]}
        required = list(dict.fromkeys(list(a.get("required", [])) + list(b.get("required", []))))
        ap = self.meet(apa, apb, depth)
        for r in required:
            if r not in props:
                props[r] = ap
            if props[r] is False:
                return False
        if ap is False:   # a key the object cannot have anyway: one spelling per object
            props = {n: v for n, v in props.items() if v is not False}
        if props:
            out["properties"] = props
        if required:
            out["required"] = required
        if ap is not True:
            out["additionalProperties"] = ap
        return out


def _conjuncts(node: dict) -> list:
    """node's parts as one flat conjunction (allOf within allOf unfolded)."""
    out = [{k: v for k, v in node.items() if k not in ("allOf", "anyOf", "$ref")}]
    if "$ref" in node:
        out.append({"$ref": node["$ref"]})
    if "anyOf" in node:
        out.append({"anyOf": node["anyOf"]})
    for part in node.get("allOf", []):
        out += _conjuncts(part) if isinstance(part, dict) and "allOf" in part else [part]
    return out


def plain_patterns(part: dict) -> dict:
    """patternProperties that say no more than additionalProperties: those whose schema is the
    one additionalProperties gives, matching no listed key, are dropped, and one pattern
    every name matches becomes additionalProperties (listed keys take its schema too)."""
    pats = part.get("patternProperties")
    if isinstance(pats, dict) and "additionalProperties" in part:
        # (a listed key a pattern matches takes the pattern's schema too: such a one stays)
        ap, listed = part["additionalProperties"], part.get("properties") or {}
        kept = {p: v for p, v in pats.items()
                if v != ap or any(may_match(p, n) for n in listed)}
        if len(kept) < len(pats):
            part = {k: v for k, v in part.items() if k != "patternProperties"}
            if kept:
                part["patternProperties"] = kept
            pats = kept
    if not (isinstance(pats, dict) and len(pats) == 1 and next(iter(pats)) in UNIVERSAL):
        return part
    schema = next(iter(pats.values()))
    rest = {k: v for k, v in part.items() if k != "patternProperties"}
    props = {n: all_of([v, schema]) for n, v in rest.get("properties", {}).items()}
    # every key matches, so none is additional: the pattern's schema is every unlisted key's
    return {**rest, **({"properties": props} if props else {}), "additionalProperties": schema}


def _type_list(types: set[str]) -> list[str]:
    return sorted(types - {"integer"} if "number" in types else types)


def _collapse(branches: list[dict]) -> list[dict]:
    """Branches equal but for one property's value as one, with the values' anyOf (exact: an
    object's keys are constrained independently)."""
    if len(branches) < 2:
        return branches
    sigs = {}
    for b in branches:   # a branch's signature: its other keywords and each property's value
        sig = _signature(b)
        sigs.setdefault((sig[0], tuple(sorted(sig[1].items()))), (b, sig))
    out = list(sigs.values())
    changed = True
    while changed and len(out) > 1:
        changed = False
        for p in dict.fromkeys(n for _, (_, props) in out for n in props):
            groups: dict[tuple, list] = {}
            kept = []
            for b, (head, props) in out:
                if p not in props:
                    kept.append((b, (head, props)))
                    continue
                rest = tuple(sorted((n, v) for n, v in props.items() if n != p))
                groups.setdefault((head, rest), []).append((b, (head, props)))
            for group in groups.values():
                if len(group) > 1:
                    changed = True
                    first, (head, props) = group[0]
                    value = any_of([g["properties"][p] for g, _ in group])
                    first = {**first, "properties": {**first["properties"], p: value}}
                    kept.append((first, (head, {**props, p: json.dumps(value, sort_keys=True)})))
                else:
                    kept.append(group[0])
            out = kept
    return [b for b, _ in out]


def _signature(b: dict) -> tuple[str, dict[str, str]]:
    head = json.dumps({k: v for k, v in b.items() if k != "properties"}, sort_keys=True)
    return head, {n: json.dumps(v, sort_keys=True) for n, v in b.get("properties", {}).items()}


def _merge_values(a: dict, b: dict, types: set[str]) -> dict | bool | None:
    """The intersection where a part lists its values (enum/const): the listed values of the
    types both allow, in every list, that the other keywords accept (judged by ``jsonschema``,
    as literals.py does); None where a validator cannot tell."""
    lists = [x["enum"] if "enum" in x else [x["const"]] for x in (a, b) if "enum" in x or "const" in x]
    if any(not isinstance(v, list) for v in lists):
        return None
    keep = [v for v in lists[0] if json_type(v) in types]
    for other in lists[1:]:
        keys = {canon(v) for v in other}
        keep = [v for v in keep if canon(v) in keys]
    for x in (a, b):
        rest = {k: v for k, v in x.items() if k not in ("enum", "const", "type")}
        if rest and keep:
            try:
                check = jsonschema.Draft202012Validator(
                    rest, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
                keep = [v for v in keep if check.is_valid(v)]
            except (jsonschema.SchemaError, Unresolvable, RecursionError):
                return None
    return {"enum": keep} if keep else False


def _scalar_parts(node: dict) -> list[dict]:
    """node's string and number keywords, as allOf parts."""
    own = {k: v for k, v in node.items() if k in _SCALAR}
    return ([own] if own else []) + list(node.get("allOf", []))


def _keep(node: dict, types: set[str]) -> dict:
    """node's keywords that read one of types (and its enum/const)."""
    return relevant({**node, "type": _type_list(types)})


def _by_type(part: dict) -> list[dict]:
    """A plain schema as a union of one part per kind its keywords read (object, array) and one
    for its other types, so that no part is a union of an object and other types."""
    types = node_types(part)
    out, rest = [], set(types)
    for kind, keys in (("object", _OBJECT), ("array", _ARRAY)):
        if kind in types and any(k in part for k in keys):
            out.append({**{k: v for k, v in part.items() if k in keys}, "type": kind})
            rest.discard(kind)
    if not out:
        return [part]
    if rest:
        out.append({"type": _type_list(rest)})
    return out
