"""Object keywords llguidance refuses or handles partly: propertyNames, minProperties,
maxProperties."""
from __future__ import annotations

import itertools

from .algebra import all_of, any_of
from .lookaround import literal_names


MAX_COMBINATIONS = 64  # branches one min/maxProperties rewrite may add


class ObjectRewrites:
    """Rewrites of propertyNames and min/maxProperties for the Sanitizer."""

    def _rewrite_property_names(self, node: dict, path: str):
        pn = node.pop("propertyNames")
        if pn is True or pn == {}:
            return
        ap = node.get("additionalProperties", True)
        props = node.get("properties", {})
        if (ap is False or ap == {"not": {}}) and not node.get("patternProperties"):
            # only the listed names can appear: forbid those that break propertyNames
            if isinstance(pn, dict) and set(pn) <= {"type", "enum", "const", "minLength", "maxLength"}:
                for name in list(props):
                    if not self._string_matches(pn, name):
                        props[name] = False
                node["properties"] = props
                return
        if isinstance(pn, dict) and isinstance(pn.get("enum"), list) and set(pn) <= {"enum", "type"}:
            names = [n for n in pn["enum"] if isinstance(n, str)]
            newprops = {n: props.get(n, ap if ap is not None else True) for n in names}
            for n in props:
                if n not in newprops:
                    newprops[n] = False
            node["properties"] = newprops
            node["additionalProperties"] = False
            node.pop("patternProperties", None) if not node.get("patternProperties") else None
            if node.get("patternProperties"):
                node["patternProperties"] = {}
            return
        if isinstance(pn, dict) and "const" in pn and set(pn) <= {"const", "type"}:
            name = pn["const"]
            node["properties"] = {n: (v if n == name else False) for n, v in props.items()}
            node["properties"].setdefault(name, ap)
            node["additionalProperties"] = False
            node.pop("patternProperties", None)
            return
        # keep only the listed properties that fit, no others
        self.note(path, "propertyNames: only listed properties whose names fit are allowed")
        node["properties"] = {n: (v if self._string_matches(pn, n) else False)
                              for n, v in props.items()}
        node["additionalProperties"] = False
        node.pop("patternProperties", None)

    def _rewrite_min_max_properties(self, node: dict, path: str):
        mn, mx = node.get("minProperties"), node.get("maxProperties")
        if mn is None and mx is None:
            return
        required = set(node.get("required") or [])
        props = node.get("properties") or {}
        closed = node.get("additionalProperties", True) is False and not node.get("patternProperties")
        if mn is not None:
            if mn <= len(required) or mn <= 0:
                node.pop("minProperties")
            elif props:
                optional = [p for p in props if p not in required and props[p] is not False]
                need = mn - len(required)
                combos = list(itertools.islice(itertools.combinations(optional, need),
                                               MAX_COMBINATIONS + 1))
                if need <= len(optional) and combos and len(combos) <= MAX_COMBINATIONS:
                    node.pop("minProperties")
                    branch = any_of([{"required": list(c)} for c in combos])
                    node.setdefault("allOf", []).append(branch)
                    if not closed:
                        self.note(path, "minProperties: met by listed properties only (narrower)")
        if mx is not None:
            listed = [p for p in props if props[p] is not False]
            if closed and len(listed) <= mx:
                node.pop("maxProperties")
            elif mx >= len(required) and closed:
                # at most mx of the listed properties: one branch per choice of optional ones
                optional = [p for p in listed if p not in required]
                k = int(mx) - len(required)
                combos = list(itertools.islice(itertools.combinations(optional, k),
                                               MAX_COMBINATIONS + 1))
                if len(combos) <= MAX_COMBINATIONS:
                    node.pop("maxProperties")
                    node.setdefault("allOf", []).append(any_of([
                        {"properties": {p: False for p in optional if p not in c}} for c in combos]))
            elif mx >= len(required):
                # closing the object to the required and a few listed properties is a subset
                optional = [p for p in listed if p not in required]
                keep = optional[: max(0, mx - len(required))]
                node["properties"] = {p: v for p, v in props.items() if p in required or p in keep}
                for p in required:
                    node["properties"].setdefault(p, True)
                node["additionalProperties"] = False
                node.pop("patternProperties", None)
                node.pop("maxProperties")
                self.note(path, f"maxProperties: only {sorted(node['properties'])} allowed (narrower)")

    def _literal_pattern_properties(self, node: dict) -> None:
        """A patternProperties entry whose pattern matches a few literal names (``^(a|b)$``)
        becomes properties entries: the same keys with the same schema (llguidance refuses
        overlapping patterns, and intersects a listed property with the patterns it matches)."""
        pats = node.get("patternProperties")
        if not isinstance(pats, dict):
            return
        props = dict(node.get("properties") or {})
        for pattern, schema in list(pats.items()):
            names = literal_names(pattern)
            if names is None:
                continue
            for n in names:
                props[n] = schema if n not in props else all_of([props[n], schema])
            del pats[pattern]
        if props:
            node["properties"] = props
        if not pats:
            del node["patternProperties"]

    def _split_dependency(self, node: dict, extra: list) -> dict | None:
        """An object whose one extra conjunct is a property dependency, anyOf [{"properties":
        {p: false}}, {"required": [p, ...]}], as an anyOf of two plain objects: the node with
        p forbidden and the node with the names required (exact; keeps the object out of an
        intersection, where its properties could not be reordered)."""
        if len(extra) != 1 or any(k in node for k in ("allOf", "anyOf", "oneOf", "$ref", "not")):
            return None
        opts = extra[0].get("anyOf") if isinstance(extra[0], dict) and len(extra[0]) == 1 else None
        if not (isinstance(opts, list) and len(opts) == 2):
            return None
        absent, present = opts
        if not (isinstance(absent, dict) and set(absent) == {"properties"}
                and len(absent["properties"]) == 1 and isinstance(present, dict)
                and set(present) == {"required"}):
            return None
        (prop, schema), = absent["properties"].items()
        if schema is not False:
            return None
        without = {**node, "properties": {**(node.get("properties") or {}), prop: False}}
        required = list(node.get("required") or [])
        required += [r for r in present["required"] if r not in required]
        return {"anyOf": [without, {**node, "required": required}]}
