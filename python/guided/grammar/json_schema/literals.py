"""An enum or const beside other keywords: the listed values the whole node accepts.

llguidance does not intersect a literal with a schema (``allOf: [{"enum": [...]}, {"not":
...}]`` is "Unsatisfiable" to it), but the node can only ever accept one of its listed values,
so the exact rewrite is the enum of those values that validate against the node. Deciding
that is a validator's job: the ``jsonschema`` package, with the root document for ``$ref``
and formats asserted, as everywhere else in this package.
"""
from __future__ import annotations

from typing import Any

import jsonschema
from referencing.exceptions import Unresolvable

from .vocabulary import ANNOTATIONS, KW_SINCE

MAX_VALUES = 1000   # literals checked for one node
_PLAIN = {"enum", "const", "type"} | ANNOTATIONS


def _candidates(node: dict, draft: int) -> list | None:
    """The values node may take when one of its own keywords or of its allOf parts lists
    them (None: no list, or nothing but the list and a type)."""
    if set(node) <= _PLAIN:
        return None
    for part in [node, *(p for p in node.get("allOf") or [] if isinstance(p, dict))]:
        if "const" in part and draft >= KW_SINCE["const"]:
            return [part["const"]]
        if isinstance(part.get("enum"), list):
            return part["enum"]
    return None


class Literals:
    """``_filter_literals`` for the Sanitizer."""

    _validator: Any = None

    def _filter_literals(self, node: dict, ctx) -> dict | bool | None:
        """{"enum": the candidates node accepts} (False if none), or None to leave node be.
        Only in the root's resource (the validator resolves $ref from there), and not where
        the draft ignores the keywords beside a $ref."""
        values = _candidates(node, ctx.draft)
        if values is None or len(values) > MAX_VALUES or ctx.base != self.root_base:
            return None
        if ctx.draft < 2019 and "$ref" in node:
            return None
        try:
            check = self._root_validator().evolve(schema=node)
            kept = [v for v in values if check.is_valid(v)]
        except (jsonschema.SchemaError, Unresolvable, RecursionError):
            return None  # the validator cannot decide here: the usual rewrite
        return {"enum": kept} if kept else False

    def _root_validator(self):
        if self._validator is None:
            cls = jsonschema.validators.validator_for(self.root, default=jsonschema.Draft202012Validator)
            self._validator = cls(self.root, format_checker=cls.FORMAT_CHECKER)
        return self._validator
