"""Array keywords llguidance refuses: uniqueItems and contains."""
from __future__ import annotations


from .algebra import all_of, as_schema


class ArrayRewrites:
    """Rewrites of uniqueItems/contains for the Sanitizer."""

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
