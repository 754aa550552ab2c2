"""oneOf: anyOf when the options are provably disjoint, otherwise each option intersected with
the complements of the options it may overlap.

Where some complement has no expression (a pattern, a format), the option it would cut is left
out (narrower). Before settling for that, the options are split by JSON type: on each type only
the keywords for that type count, so options that differ only on strings (a format and a
pattern) are compared as strings, and a type on which two options say nothing is one on which
both always match, so oneOf excludes it exactly.
"""
from __future__ import annotations

from typing import Any

from .algebra import all_of, any_of, as_schema, relevant, type_set

_TYPE_GROUPS = ("null", "boolean", "number", "string", "array", "object")   # number: with integer
_APPLICATORS = ("allOf", "anyOf", "oneOf", "not", "if", "$ref")


class OneOfRewrite:
    """``_rewrite_one_of`` for the Sanitizer (uses ``disjoint``, ``types`` and ``neg``)."""

    def _rewrite_one_of(self, options: list, path: str, types: Any = None) -> Any:
        """``types``: the "type" beside the oneOf (the options only matter on those)."""
        opts = [o for o in (as_schema(o) for o in options) if o is not False]
        if types is not None:
            opts = [o for o in (self._restricted(o, type_set(types)) for o in opts) if o is not False]
        result, narrowed = self._one_of(opts)
        if narrowed:
            by_type = [self._one_of(self._on_type(opts, t)) for t in _TYPE_GROUPS]
            if sum(n for _, n in by_type) < narrowed:
                result = any_of([all_of([{"type": t}, r]) for t, (r, _) in zip(_TYPE_GROUPS, by_type)
                                 if r is not False])
                narrowed = sum(n for _, n in by_type)
        if narrowed:
            self.note(path, f"oneOf: {narrowed} of {len(opts)} options that may overlap others are "
                            "not allowed (narrower)")
        return result

    def _keys_outside(self, a: Any, b: Any) -> list:
        """Objects with a key that a lists and closed b forbids: part of b's complement that
        the keyword-wise complement leaves out ("has a key b does not allow")."""
        _, pa, _, _ = self._obj_info(a, 0)
        _, pb, closed, forbidden = self._obj_info(b, 0)
        if not closed and not forbidden:
            return []
        keys = [k for k, v in pa.items() if v is not False and (k in forbidden or (closed and k not in pb))]
        return [{"type": "object", "required": [k]} for k in keys]

    def _on_type(self, opts: list, t: str) -> list:
        """The options restricted to type t (those that allow none of it left out)."""
        group = {t, "integer"} if t == "number" else {t}
        return [r for r in (self._restricted(o, group) for o in opts) if r is not False]

    def _restricted(self, o: Any, group: set[str]) -> Any:
        """Option o on the types in group only (False where it allows none of them), with the
        keywords for other types dropped."""
        ts = self.types(o, 0)
        kept = group if ts is None else group & ts
        if not kept:
            return False
        names = sorted(kept - {"integer"} if "number" in kept else kept)
        t = names if len(names) > 1 else names[0]
        if isinstance(o, dict) and not any(k in o for k in _APPLICATORS):
            return relevant({**o, "type": t})
        return all_of([o, {"type": t}])

    def _one_of(self, opts: list) -> tuple[Any, int]:
        """(the rewrite, how many options were left out for want of a complement)."""
        n = len(opts)
        if n == 0:
            return False, 0
        if n == 1:
            return opts[0], 0
        overlap = [[False] * n for _ in range(n)]
        for i in range(n):
            for j in range(i + 1, n):
                if not self.disjoint(opts[i], opts[j]):
                    overlap[i][j] = overlap[j][i] = True
        if not any(any(r) for r in overlap):
            return {"anyOf": opts}, 0
        branches = []
        narrowed = 0
        for i in range(n):
            parts = [opts[i]]
            ok = True
            ta = self.types(opts[i], 0)
            for j in range(n):
                if overlap[i][j]:
                    neg = self.neg(opts[j], 0)
                    outside = self._keys_outside(opts[i], opts[j])
                    if outside:
                        neg = any_of(([neg] if neg is not None else []) + outside)
                    # a complement may be narrower than the real one (complement.py); only a
                    # type-only option's complement is surely exact
                    exact = isinstance(opts[j], dict) and self._type_only(opts[j])
                    if neg is None or neg is False:
                        narrowed += not exact   # nothing (expressible) of option i is left
                        ok = False
                        break
                    tn = self.types(neg, 0)
                    if ta is not None and tn is not None:
                        if not (ta & tn):
                            narrowed += not exact
                            ok = False
                            break
                        if ta <= tn and self._type_only(neg):
                            continue  # the complement only excludes types option i lacks
                    parts.append(neg)
            if ok:
                branches.append(all_of(parts))
        return (any_of(branches) if branches else False), narrowed
