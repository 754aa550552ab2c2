"""Conservative analysis of sanitised schemas: the types and finite values a schema allows,
implication, and proofs that two schemas are disjoint (for oneOf)."""
from __future__ import annotations

import json
from typing import Any

import jsonschema

from .algebra import canon, json_type, type_set
from .oracle import unsatisfiable
from .refs import Unsupported
from .regex import first_chars, search
from .vocabulary import ANNOTATIONS


MAX_DEPTH = 6  # nested schemas looked through (refs can be recursive)


class Analysis:
    """What a schema allows, for the rewrites (uses the Sanitizer's ``resolve``)."""

    @staticmethod
    def _type_only(s: Any) -> bool:
        if isinstance(s, dict):
            if set(s) == {"type"}:
                return True
            if set(s) == {"anyOf"}:
                return all(Analysis._type_only(o) for o in s["anyOf"])
        return False

    def _strings(self, s: Any, depth: int = 0):
        """(patterns, finite string values or None) that a string schema imposes."""
        s = self.deref(s, depth)
        pats: list[str] = []
        vals = None
        if not isinstance(s, dict) or depth > MAX_DEPTH:
            return pats, vals
        if isinstance(s.get("pattern"), str):
            pats.append(s["pattern"])
        if "const" in s:
            vals = [s["const"]]
        elif isinstance(s.get("enum"), list):
            vals = list(s["enum"])
        for o in s.get("allOf", []) if isinstance(s.get("allOf"), list) else []:
            p, v = self._strings(o, depth + 1)
            pats += p
            if v is not None:
                vals = v if vals is None else [x for x in vals if x in v]
        return pats, vals

    def _strings_disjoint(self, a: Any, b: Any) -> bool:
        pa, va = self._strings(a)
        pb, vb = self._strings(b)
        for vals, pats in ((va, pb), (vb, pa)):
            if vals is not None and pats and all(isinstance(v, str) for v in vals):
                if all(any(not search(p, v) for p in pats) for v in vals):
                    return True
        for x in pa:
            fx = first_chars(x)
            if fx is None:
                continue
            for y in pb:
                fy = first_chars(y)
                if fy is not None and not (fx & fy):
                    return True
        return False

    def _accepts_any(self, s: Any, values: set[str]) -> bool:
        """Whether s may accept one of values (canonical keys); True unless a validator shows
        that it accepts none (only where s, resolved, has no $ref left)."""
        s = self.deref(s, 0)
        if not isinstance(s, (dict, bool)) or "$ref" in json.dumps(s) or len(values) > 1000:
            return True
        try:
            cls = jsonschema.Draft202012Validator
            check = cls(s, format_checker=cls.FORMAT_CHECKER)
            return any(check.is_valid(json.loads(v)) for v in values)
        except (jsonschema.SchemaError, RecursionError, ValueError):
            return True

    def deref(self, s: Any, depth: int) -> Any:
        while isinstance(s, dict) and "$ref" in s and depth < MAX_DEPTH:
            try:
                target = self.resolve(s["$ref"])
            except Unsupported:
                return None
            if len(s) == 1:
                s = target
            else:
                rest = {k: v for k, v in s.items() if k != "$ref"}
                s = {"allOf": [target, rest]}
            depth += 1
        if isinstance(s, dict) and "$ref" in s:
            return None
        return s

    def types(self, s: Any, depth: int) -> set[str] | None:
        """The JSON types s may match (integer ⊂ number), or None when unknown (= all)."""
        if depth > MAX_DEPTH:
            return None
        ref = s.get("$ref") if isinstance(s, dict) else None
        s = self.deref(s, depth)
        if s is None and isinstance(ref, str) and ref.startswith("#/$defs/"):
            # a reference still being rewritten (recursion): its own 'type' bounds it
            raw = self.def_nodes.get(ref[len("#/$defs/"):])
            if isinstance(raw, dict) and isinstance(raw.get("type"), (str, list)):
                return type_set(raw["type"])
            return None
        if s is None or s is True:
            return None
        if s is False:
            return set()
        if not isinstance(s, dict):
            return None
        result: set[str] | None = None

        def meet(ts):
            nonlocal result
            if ts is None:
                return
            result = set(ts) if result is None else result & ts
        if "type" in s:
            meet(type_set(s["type"]))
        if "const" in s:
            meet(type_set(json_type(s["const"])))
        if isinstance(s.get("enum"), list):
            ts = set()
            for v in s["enum"]:
                ts |= type_set(json_type(v))
            meet(ts)
        for k in ("anyOf", "oneOf"):
            if isinstance(s.get(k), list):
                u: set[str] | None = set()
                for o in s[k]:
                    t = self.types(o, depth + 1)
                    if t is None:
                        u = None
                        break
                    u |= t
                meet(u)
        if isinstance(s.get("allOf"), list):
            for o in s["allOf"]:
                meet(self.types(o, depth + 1))
        if result is not None and "integer" in result and "number" not in result:
            pass
        return result

    def values(self, s: Any, depth: int) -> set[str] | None:
        """Canonical keys of the finite set of values s allows, or None if not finite/known."""
        s = self.deref(s, depth)
        if not isinstance(s, dict) or depth > MAX_DEPTH:
            return None
        vals = None
        if "const" in s:
            vals = {canon(s["const"])}
        if isinstance(s.get("enum"), list):
            e = {canon(v) for v in s["enum"]}
            vals = e if vals is None else vals & e
        if vals is None and isinstance(s.get("allOf"), list):
            for o in s["allOf"]:
                v = self.values(o, depth + 1)
                if v is not None:
                    vals = v if vals is None else vals & v
        if vals is None and isinstance(s.get("anyOf"), list):
            u = set()
            for o in s["anyOf"]:
                v = self.values(o, depth + 1)
                if v is None:
                    return None
                u |= v
            vals = u
        return vals

    def _obj_info(self, s: Any, depth: int):
        """(required names, properties dict, closed?) of an object schema (merged over allOf)."""
        s = self.deref(s, depth)
        if not isinstance(s, dict):
            return set(), {}, False, set()
        req = set(s.get("required") or []) if isinstance(s.get("required"), list) else set()
        props = dict(s.get("properties") or {}) if isinstance(s.get("properties"), dict) else {}
        closed = s.get("additionalProperties") is False and not s.get("patternProperties")
        forbidden = {p for p, v in props.items() if v is False}
        if isinstance(s.get("allOf"), list) and depth < MAX_DEPTH:
            for o in s["allOf"]:
                r, p, c, f = self._obj_info(o, depth + 1)
                req |= r
                for k, v in p.items():
                    props.setdefault(k, v)
                    if k in props and props[k] is not v:
                        props[k] = {"allOf": [props[k], v]} if props[k] is not True else v
                forbidden |= f
        return req, props, closed, forbidden

    def disjoint(self, a: Any, b: Any) -> bool:
        """True only if no instance satisfies both a and b. Where a or b refers to a definition
        still being walked (a recursive oneOf), its raw schema stands in for the structural
        checks (required names, listed values, types): the sanitised one is the same or
        narrower, so what separates the raw ones separates it too."""
        if self._disjoint(a, b):
            return True
        if not self.in_progress:
            return False
        self._raw = True
        try:
            return self._disjoint(a, b)
        finally:
            self._raw = False

    def _disjoint(self, a: Any, b: Any) -> bool:
        ta, tb = self.types(a, 0), self.types(b, 0)
        if ta is not None and tb is not None:
            common = ta & tb
            if not common:
                return True
        else:
            common = ta if tb is None else tb
        va, vb = self.values(a, 0), self.values(b, 0)
        if va is not None and vb is not None and not (va & vb):
            return True
        for vals, other in ((va, b), (vb, a)):
            if vals is not None and not self._raw and not self._accepts_any(other, vals):
                return True
        if ta is not None and tb is not None and common <= {"string"}:
            if self._strings_disjoint(a, b):
                return True
            both = {"allOf": [self.deref(a, 0), self.deref(b, 0)]}
            if not self._raw and "$ref" not in json.dumps(both) and unsatisfiable(both):
                return True   # llguidance intersects the two (patterns, formats, lengths)
        # objects told apart by a property
        if common is None or "object" in common:
            ra, pa, ca, fa = self._obj_info(a, 0)
            rb, pb, cb, fb = self._obj_info(b, 0)
            only_objects = (ta is not None and ta <= {"object"}) or (tb is not None and tb <= {"object"})
            if not only_objects:
                return False
            for p in ra & rb:
                if p in pa and p in pb:
                    xa, xb = self.values(pa[p], 0), self.values(pb[p], 0)
                    if xa is not None and xb is not None and not (xa & xb):
                        return True
                    ya, yb = self.types(pa[p], 0), self.types(pb[p], 0)
                    if ya is not None and yb is not None and not (ya & yb):
                        return True
            for p in ra:
                if p in fb or (cb and p not in pb):
                    return True
            for p in rb:
                if p in fa or (ca and p not in pa):
                    return True
        return False

    def _implies(self, a: Any, b: Any) -> bool:
        """Whether every instance of a is an instance of b (conservative)."""
        if b is True or b == {}:
            return True
        if canon(a) == canon(b):
            return True
        if isinstance(b, dict) and set(b) == {"type"} and isinstance(a, dict):
            ta = self.types(a, 0)
            tb = type_set(b["type"])
            return ta is not None and ta <= tb
        return False

    def _string_matches(self, pn: Any, name: str) -> bool:
        """Conservative: False unless name surely satisfies pn."""
        if pn is True or pn == {}:
            return True
        if not isinstance(pn, dict):
            return False
        for k, v in pn.items():
            if k == "type":
                if "string" not in type_set(v):
                    return False
            elif k == "enum":
                if name not in v:
                    return False
            elif k == "const":
                if name != v:
                    return False
            elif k == "minLength":
                if len(name) < v:
                    return False
            elif k == "maxLength":
                if len(name) > v:
                    return False
            elif k == "pattern":
                import re
                try:
                    if not re.search(v, name):
                        return False
                except re.error:
                    return False
            elif k in ANNOTATIONS or k == "format":
                continue
            else:
                return False
        return True
