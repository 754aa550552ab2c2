"""Array keywords llguidance refuses: uniqueItems and contains.

uniqueItems is exact where the items take a few literal values (the arrays of distinct values
are listed) or one value (at most one item); elsewhere arrays are limited to one item.
"""
from __future__ import annotations

import itertools
import math

from .algebra import all_of, as_schema, canon, json_type, type_set

MAX_UNIQUE_ARRAYS = 512  # arrays of distinct literal values listed for one uniqueItems


class ArrayRewrites:
    """Rewrites of uniqueItems/contains for the Sanitizer."""

    def _unique_literal_items(self, node: dict) -> bool:
        """uniqueItems over items with a few literal values: node becomes the enum of every
        array of distinct values whose length minItems/maxItems allow (exact)."""
        if "items" not in node or set(node) - {"type", "items", "minItems", "maxItems"}:
            return False
        if "type" not in node or type_set(node["type"]) != {"array"}:
            return False
        items = self.deref(node["items"], 0)
        if not isinstance(items, dict) or set(items) - {"type", "enum", "const"}:
            return False
        if "const" in items and "enum" in items:
            return False
        values = [items["const"]] if "const" in items else items.get("enum")
        if not isinstance(values, list):
            return False
        if "type" in items:
            values = [v for v in values if json_type(v) in type_set(items["type"])]
        seen: dict = {}
        for v in values:
            seen.setdefault(canon(v), v)
        distinct = list(seen.values())
        lo = int(node.get("minItems", 0))
        hi = min(int(node.get("maxItems", len(distinct))), len(distinct))
        count = sum(math.perm(len(distinct), n) for n in range(lo, hi + 1))
        if not 0 < count <= MAX_UNIQUE_ARRAYS:
            return False
        arrays = [list(p) for n in range(lo, hi + 1) for p in itertools.permutations(distinct, n)]
        node.clear()
        node["enum"] = arrays
        return True

    def _single_valued_items(self, node: dict) -> bool:
        items = node.get("items")
        if isinstance(items, dict):
            if "const" in items:
                node["maxItems"] = min(node.get("maxItems", 1), 1)
                return True
            if isinstance(items.get("enum"), list) and len(items["enum"]) == 1:
                node["maxItems"] = min(node.get("maxItems", 1), 1)
                return True
        return False

    def _rewrite_contains(self, node: dict, path: str):
        contains = node.pop("contains")
        min_c = node.pop("minContains", 1)
        max_c = node.pop("maxContains", None)
        if max_c is not None:
            self.note(path, "maxContains not enforced exactly: arrays limited to maxContains items")
            mx = node.get("maxItems")
            node["maxItems"] = max_c if mx is None else min(mx, max_c)
        if min_c == 0:
            return
        items = node.get("items", True)
        uniform = "prefixItems" not in node and not isinstance(items, list)
        if contains is True or contains == {} or (uniform and self._implies(items, contains)):
            node["minItems"] = max(node.get("minItems", 0), min_c)
            return
        if contains is False:
            # no array can contain a match
            node["maxItems"] = 0
            node["minItems"] = max(node.get("minItems", 0), 1)
            return
        # the first min_c items must satisfy 'contains' (a subset of the valid arrays)
        self.note(path, "contains: the first item(s) must match (narrower than the schema)")
        prefix = node.pop("prefixItems", None)
        tuple_items = node.get("items") if isinstance(node.get("items"), list) else None
        if tuple_items is not None:
            prefix = node.pop("items")
            rest = node.pop("additionalItems", True)
            node["items"] = rest
        prefix = list(prefix or [])
        rest_items = node.get("items", True)
        for i in range(min_c):
            base = prefix[i] if i < len(prefix) else rest_items
            entry = all_of([as_schema(base), as_schema(contains)])
            if i < len(prefix):
                prefix[i] = entry
            else:
                prefix.append(entry)
        node["prefixItems"] = prefix
        node["minItems"] = max(node.get("minItems", 0), min_c)
