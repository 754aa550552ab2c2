"""Property order: llguidance accepts an object's listed properties only in the order of
``properties`` (and other keys after them); JSON Schema allows any order. Our writer
(writer.py) takes most objects in any order itself; in what it hands to llguidance whole (a
leaf: an intersection it cannot merge, or a schema it does not take) the object becomes
an anyOf of itself with its properties in a few orders: the schema's, and the required ones
first in each order (up to MAX_PERMUTED of them, else in the order of ``required``).

Every variant has the same keywords with the same meaning and lists each key once, so the
union accepts exactly the instances the object accepts; only the order of keys in the text
differs. At the root, a few unlisted keys a document often starts with ("$schema", "$id",
"title", ...) may also come first (metadata_first). What stays out: other orders of optional
keys, other unlisted keys before a listed one, and objects under an intersection (allOf,
or anyOf/oneOf/$ref beside other keywords), where llguidance merges the parts. The variants
copy the property schemas, so the growth of one schema is bounded (MAX_GROWTH).

The code can also move optional properties into literal ``patternProperties`` (any order);
MAX_PATTERNS = 0 keeps that off, see there.
"""
from __future__ import annotations

import itertools
import json
import re
from typing import Any

MAX_PERMUTED = 2    # every order of up to this many listed properties (3! = 6 variants
                    # tripled the median compile time for one more bench schema)
MAX_COPIED = 100_000 # characters of property schemas one object's variants may repeat
MAX_GROWTH = 24_000  # characters all the variants of one schema may add (llguidance's size limit)
# Optional properties as literal patternProperties: off. llguidance lets a pattern key repeat,
# and a small model then writes the same keys again and again until max_tokens (seen in
# tests/grammar/test_structured.py: {"a":1,"b":2,"a":1,...} cut by the length limit).
MAX_PATTERNS = 0
# Keys a document often starts with though its schema does not list them ("$schema" in a
# config file): at the root they may also come first (see metadata_first).
METADATA_KEYS = ("$schema", "$id", "title", "description", "$comment")
_REF = "#/$defs/"
_SIBLING_READERS = ("allOf", "anyOf", "oneOf", "$ref", "not", "if",
                    "dependentSchemas", "dependentRequired", "dependencies", "propertyNames",
                    "unevaluatedProperties", "minProperties", "maxProperties")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "dependentSchemas")
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def _literal(name: str) -> str | None:
    """An anchored regex matching exactly ``name`` (None for names we do not escape)."""
    if any(c in '"\\' or ord(c) < 0x20 for c in name):
        return None
    return "^" + "".join("\\" + c if c in _REGEX_META else c for c in name) + "$"


def _intersection(node: dict) -> bool:
    """Whether llguidance intersects node's parts (its merge of properties with
    patternProperties is not JSON Schema's, so nothing under one is rewritten)."""
    if isinstance(node.get("allOf"), list):
        return True
    if "$ref" in node and len(node) > 1:
        return True
    return any(k in node and len(node) > 1 for k in ("anyOf", "oneOf"))


def def_refs(node: Any):
    """The $defs names node refers to (anywhere in it)."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str) and v.startswith(_REF):
                yield v[len(_REF):]
            elif k not in ("enum", "const"):
                yield from def_refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from def_refs(v)


def _under_intersections(node: Any, out: set[str]) -> None:
    """Add to out the $defs names referenced anywhere under an intersection."""
    if isinstance(node, list):
        for v in node:
            _under_intersections(v, out)
    elif isinstance(node, dict):
        if _intersection(node):
            out.update(def_refs(node))
            return
        for k, v in node.items():
            if k not in ("enum", "const"):
                _under_intersections(v, out)


def frozen_defs(root: Any, defs: dict) -> set[str]:
    """$defs an intersection reaches (directly or through other definitions)."""
    seeds: set[str] = set()
    _under_intersections(root, seeds)
    for d in defs.values():
        _under_intersections(d, seeds)
    frozen, stack = set(), list(seeds)
    while stack:
        n = stack.pop()
        if n in frozen or n not in defs:
            continue
        frozen.add(n)
        stack.extend(def_refs(defs[n]))
    return frozen


def _orders(names: list[str], required: list[str]):
    """Sets of orders for the listed properties, from the most to the fewest variants."""
    if len(names) <= MAX_PERMUTED:
        yield [list(p) for p in itertools.permutations(names)]
    first = [r for r in required if r in names]
    rest = [n for n in names if n not in first]
    orders = [names]
    heads = itertools.permutations(first) if len(first) <= MAX_PERMUTED else [first]
    for head in heads:  # the required ones first, in each order (or in required's)
        if list(head) + rest not in orders:
            orders.append(list(head) + rest)
    yield orders
    yield [names]


def may_match(pattern: str, name: str) -> bool:
    """Whether name may match pattern (True when Python cannot tell)."""
    try:
        return re.search(pattern, name) is not None
    except (re.error, RecursionError):
        return True


def _takes_metadata(node: Any) -> bool:
    """Whether node is a plain object schema with listed properties on which an unlisted key
    is allowed."""
    if not isinstance(node, dict) or not isinstance(node.get("properties"), dict) or _intersection(node):
        return False
    if any(k in node for k in (*_SIBLING_READERS, "enum", "const")):
        return False
    return node.get("additionalProperties", True) is not False and node.get("type", "object") == "object"


def metadata_first(node: Any) -> Any:
    """The root object, or each of its order variants, also with METADATA_KEYS listed first
    where the schema neither lists nor patterns them: an anyOf of those and the original.
    Exact: such a key gets the schema additionalProperties gives it, and is optional."""
    variants = node["anyOf"] if isinstance(node, dict) and set(node) == {"anyOf"} else [node]
    if not all(_takes_metadata(v) for v in variants):
        return node
    front = []
    for v in variants:
        props, patterns = v.get("properties") or {}, v.get("patternProperties") or {}
        names = [n for n in METADATA_KEYS if n not in props and not any(may_match(p, n) for p in patterns)]
        if names:
            extra = v.get("additionalProperties", True)
            front.append({**v, "properties": {**{n: extra for n in names}, **props}})
    return {"anyOf": front + variants} if front else node


def in_schema_orders(node: Any, defs: dict) -> tuple[Any, dict]:
    """node and its $defs with each plain object's order variants (and, for a root object,
    metadata keys first); definitions an intersection reaches are left as they are."""
    order = PropertyOrder()
    frozen = frozen_defs(node, defs)
    node = metadata_first(order._any_order(node))
    return node, {n: (d if n in frozen else order._any_order(d)) for n, d in defs.items()}


class PropertyOrder:
    """``_any_order`` for the Sanitizer (after the walk, on the output and $defs)."""

    _growth_left = MAX_GROWTH

    def _any_order(self, node: Any) -> Any:
        if isinstance(node, list):
            return [self._any_order(v) for v in node]
        if not isinstance(node, dict):
            return node
        if _intersection(node):
            return node
        node = {k: self._any_order_in(k, v) for k, v in node.items()}
        props = node.get("properties")
        if not isinstance(props, dict) or len(props) < 2 or any(k in node for k in _SIBLING_READERS):
            return node
        own = node.get("patternProperties") or {}
        required = [r for r in node.get("required") or [] if r in props]
        movable = [n for n in props if n not in required and _literal(n) is not None
                   and not any(may_match(p, n) for p in own)]
        if len(movable) > MAX_PATTERNS:
            movable = []
        listed = [n for n in props if n not in movable]
        patterns = {**own, **{_literal(n): props[n] for n in movable}}
        if not listed:
            return {**{k: v for k, v in node.items() if k != "properties"},
                    "patternProperties": patterns}
        for orders in _orders(listed, required):
            variants = [{**node, "properties": {n: props[n] for n in order},
                         **({"patternProperties": patterns} if patterns else {})}
                        for order in orders]
            if movable:
                # the schema's own order keeps the movable properties before listed ones
                variants.append(node)
            cost = len(json.dumps(props)) * (len(variants) - 1)
            size = len(json.dumps(props)) * len(variants)
            if len(variants) > 1 and size <= MAX_COPIED and cost <= self._growth_left:
                self._growth_left -= cost
                return {"anyOf": variants}
        return node

    def _any_order_in(self, key: str, value: Any) -> Any:
        """_any_order on the schemas a keyword holds."""
        if key in ("enum", "const"):
            return value
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            return {n: self._any_order(v) for n, v in value.items()}
        return self._any_order(value)
