"""Keeping the output flat: llguidance refuses a recursive $ref beside other keywords
("circular references with sibling keys"), so a type beside an anyOf is pushed into or
dropped from its options where that is exact."""
from __future__ import annotations

from typing import Any

from .algebra import any_of, type_set


class Flatten:
    """``_push_types``, ``_simplify`` and ``_inline_false_refs`` for the Sanitizer."""

    def _push_types(self, node: Any) -> Any:
        """{"type": T, "anyOf": [{"$ref": X}, ...]} → {"anyOf": [{"$ref": X∧T}, ...]} with X∧T a
        copy of definition X narrowed to T: llguidance refuses a recursive $ref beside other
        keywords, and this intersection is exact."""
        if isinstance(node, list):
            return [self._push_types(v) for v in node]
        if not isinstance(node, dict):
            return node
        node = {k: (self._push_types(v) if k not in ("enum", "const") else v)
                for k, v in node.items()}
        if not (set(node) == {"type", "anyOf"} and isinstance(node["anyOf"], list)):
            return node
        ts = type_set(node["type"])
        opts = []
        for o in node["anyOf"]:
            if isinstance(o, dict) and set(o) == {"$ref"} and o["$ref"].startswith("#/$defs/"):
                name = o["$ref"][len("#/$defs/"):]
                d = self.defs.get(name)
                if not isinstance(d, dict) or any(k in d for k in ("anyOf", "allOf", "oneOf", "$ref")):
                    return node
                t = ts if "type" not in d else ts & type_set(d["type"])
                if not t:
                    continue
                tname = f"{name}_{'_'.join(sorted(t))}"
                if tname not in self.defs:
                    self.defs[tname] = {**d, "type": sorted(t)}
                opts.append({"$ref": "#/$defs/" + tname})
            elif isinstance(o, dict) and not any(k in o for k in ("anyOf", "allOf", "oneOf", "$ref")):
                t = ts if "type" not in o else ts & type_set(o["type"])
                if t:
                    opts.append({**o, "type": sorted(t)})
            else:
                return node
        return any_of(opts) if opts else False

    def _simplify(self, node: Any) -> Any:
        """{"type": T, "anyOf": [...]} with options of known types: drop the type (recursive
        refs under an intersection are refused by llguidance) or the options it excludes."""
        if not (isinstance(node, dict) and set(node) == {"type", "anyOf"}
                and isinstance(node["anyOf"], list)):
            return node
        ts = type_set(node["type"])
        keep = []
        for o in node["anyOf"]:
            to = self.types(o, 0)
            if to is None or not to <= ts:
                if to is not None and not (to & ts):
                    continue  # excluded by the type
                return node
            keep.append(o)
        return any_of(keep) if keep else False

    def _inline_false_refs(self, node: Any) -> Any:
        """{"$ref": X} with X false becomes false: llguidance refuses a reference to an
        unsatisfiable definition even where the schema may leave it out (an optional
        property), and false there means the same."""
        if isinstance(node, list):
            return [self._inline_false_refs(v) for v in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            if self.defs.get(ref[len("#/$defs/"):], True) is False:
                return False
        return {k: (v if k in ("enum", "const") else self._inline_false_refs(v))
                for k, v in node.items()}
