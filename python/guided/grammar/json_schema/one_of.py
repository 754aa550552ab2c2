"""oneOf: anyOf when the options are provably disjoint, otherwise each option intersected with
the complements of the options it may overlap."""
from __future__ import annotations

from typing import Any

from .algebra import all_of, any_of, as_schema


class OneOfRewrite:
    """``_rewrite_one_of`` for the Sanitizer (uses ``disjoint``, ``types`` and ``neg``)."""

    def _rewrite_one_of(self, options: list, path: str) -> Any:
        opts = [as_schema(o) for o in options]
        opts = [o for o in opts if o is not False]
        n = len(opts)
        if n == 0:
            return False
        if n == 1:
            return opts[0]
        overlap = [[False] * n for _ in range(n)]
        for i in range(n):
            for j in range(i + 1, n):
                if not self.disjoint(opts[i], opts[j]):
                    overlap[i][j] = overlap[j][i] = True
        if not any(any(r) for r in overlap):
            return {"anyOf": opts}
        branches = []
        dropped = 0
        for i in range(n):
            parts = [opts[i]]
            ok = True
            ta = self.types(opts[i], 0)
            for j in range(n):
                if overlap[i][j]:
                    neg = self.neg(opts[j], 0)
                    if neg is None or neg is False:
                        ok = False
                        break
                    tn = self.types(neg, 0)
                    if ta is not None and tn is not None:
                        if not (ta & tn):
                            ok = False  # nothing of option i is left
                            break
                        if ta <= tn and self._type_only(neg):
                            continue  # the complement only excludes types option i lacks
                    parts.append(neg)
            if ok:
                branches.append(all_of(parts))
            else:
                dropped += 1
        if dropped:
            self.note(path, f"oneOf: {dropped} of {n} options that may overlap others are not "
                            "allowed (narrower)")
        return any_of(branches) if branches else False
