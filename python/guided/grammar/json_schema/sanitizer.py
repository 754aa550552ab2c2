"""The Sanitizer: walks a schema once (children first), resolving refs into one $defs table
and rewriting each node's keywords into ones llguidance accepts, the same or narrower."""
from __future__ import annotations

import copy
from typing import Any

from .algebra import all_of, any_of, as_schema, type_set
from .analysis import Analysis
from .arrays import ArrayRewrites
from .checks import check_keywords
from .complement import Complement
from .flatten import Flatten
from .formats import FORMAT_ALIASES, FORMAT_PATTERNS, KNOWN_FORMATS, REFERENCE_FORMATS, RELATIVE_REF
from .literals import Literals
from .lookaround import rewrite_pattern
from .objects import ObjectRewrites
from .one_of import OneOfRewrite
from .property_order import in_schema_orders
from .refs import ROOT_URI, Ctx, Refs, Unsupported, pointer_escape
from .vocabulary import ANNOTATIONS, KW_SINCE, TYPES


MAX_STEPS = 200_000  # sub-schemas visited while rewriting one schema


def sanitize_json_schema(schema: dict | bool, any_order: bool = True) -> tuple[dict | bool, list[str]]:
    """(an equivalent or narrower schema llguidance accepts, notes on what was narrowed).
    ``any_order=False`` leaves out property_order's variants (the writer orders objects itself
    and adds them to the leaves it hands to llguidance)."""
    if not isinstance(schema, (dict, bool)):
        raise ValueError("a JSON schema must be an object or a boolean")
    s = Sanitizer(copy.deepcopy(schema))
    s.any_order = any_order
    out = s.run()
    return out, s.notes


class Sanitizer(Refs, Analysis, Complement, ArrayRewrites, ObjectRewrites, OneOfRewrite, Flatten,
                Literals):
    """One schema's rewrite; each base class holds one concern (see its module)."""

    def __init__(self, root: Any):
        self.root = root
        self.notes: list[str] = []
        self.resources: dict[str, tuple[Any, Ctx]] = {}   # absolute URI → (node, ctx)
        self.anchors: dict[str, Any] = {}                   # URI#name → node
        self.ctx: dict[int, Ctx] = {}                       # id(node) → ctx
        self.defs: dict[str, Any] = {}                      # output $defs
        self.def_names: dict[int, str] = {}                 # id(target) → name in $defs
        self.queue: list[tuple[Any, Ctx, str]] = []
        self.in_progress: set[str] = set()
        self.def_nodes: dict[str, Any] = {}
        self.steps = 0
        self.any_order = True

    def run(self):
        root = self.root
        if isinstance(root, bool):
            return root
        ctx = self._index(root, Ctx(2020, ROOT_URI), top=True)
        self.root_base = ctx.base
        out = self.walk(root, "#", ctx)
        while self.queue:
            node, nctx, name = self.queue.pop()
            if name not in self.defs:
                self._walk_def(node, nctx, name)
        out = self._push_types(out)
        done: set[str] = set()
        while len(done) < len(self.defs):
            for name in [n for n in self.defs if n not in done]:
                done.add(name)
                self.defs[name] = self._push_types(self.defs[name])
        if any(d is False for d in self.defs.values()):
            out = self._inline_false_refs(out)
            self.defs = {n: self._inline_false_refs(d) for n, d in self.defs.items()}
        if self.any_order:
            out, self.defs = in_schema_orders(out, self.defs)
        if isinstance(out, dict) and self.defs:
            out = dict(out)
            out["$defs"] = self.defs
        elif self.defs and out is not False:
            out = {"allOf": [out if out is not True else {}], "$defs": self.defs}
        return out

    # ---- the walk -----------------------------------------------------------------------

    def note(self, path: str, msg: str):
        self.notes.append(f"{path}: {msg}")

    def walk(self, node: Any, path: str, ctx: Ctx | None = None) -> Any:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            # not a schema: leave it to llguidance to reject
            return node
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise ValueError("the JSON schema is too complex to rewrite")
        ctx = self.ctx.get(id(node)) or self._node_ctx(node, ctx or Ctx(2020, ROOT_URI))
        literals = self._filter_literals(node, ctx)
        if literals is not None:
            return literals
        draft = ctx.draft
        out = {}
        for k, v in node.items():
            if k in ANNOTATIONS or k in ("$schema", "$id", "id", "$anchor", "definitions", "$defs",
                                          "$dynamicAnchor", "$recursiveAnchor"):
                continue
            since = KW_SINCE.get(k)
            if since is not None and draft < since:
                continue  # not a keyword in this draft: validators ignore it
            out[k] = v
        node = out
        check_keywords(node, path)
        if draft == 4:
            for kw, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
                if isinstance(node.get(kw), bool):
                    if node.pop(kw) and bound in node:
                        node[kw] = node.pop(bound)
        if draft < 2020:
            if isinstance(node.get("items"), list):
                node["prefixItems"] = node.pop("items")
                if "additionalItems" in node:
                    node["items"] = node.pop("additionalItems")
            else:
                node.pop("additionalItems", None)
        else:
            node.pop("additionalItems", None)
        # children first
        for k in ("properties", "patternProperties", "dependentSchemas"):
            if isinstance(node.get(k), dict):
                node[k] = {n: self.walk(v, f"{path}/{k}/{pointer_escape(n)}", ctx) for n, v in node[k].items()}
        for k in ("additionalProperties", "contains", "not", "if", "then", "items",
                  "else", "propertyNames", "unevaluatedProperties", "unevaluatedItems"):
            if k in node and isinstance(node[k], (dict, bool)):
                node[k] = self.walk(node[k], f"{path}/{k}", ctx)
        for k in ("anyOf", "allOf", "oneOf", "prefixItems"):
            if isinstance(node.get(k), list):
                node[k] = [self.walk(v, f"{path}/{k}/{i}", ctx) for i, v in enumerate(node[k])]
        if isinstance(node.get("dependencies"), dict):
            node["dependencies"] = {n: (self.walk(v, f"{path}/dependencies/{pointer_escape(n)}", ctx)
                                        if isinstance(v, (dict, bool)) else v)
                                    for n, v in node["dependencies"].items()}
        ref = node.get("$ref")
        if isinstance(ref, str):
            try:
                node["$ref"] = "#/$defs/" + self.ref_name(ref, ctx)
            except Unsupported as e:
                raise ValueError(f"unsupported $ref {ref!r}: {e} (only references inside the "
                                 "schema are resolved)") from None
            if draft < 2019:
                # before 2019-09, keywords beside $ref are ignored
                node = {"$ref": node["$ref"]}
        for k in ("$recursiveRef", "$dynamicRef"):
            if k in node:
                raise ValueError(f"{k} is not supported")
        return self.rewrite(node, path)

    def rewrite(self, node: dict, path: str) -> Any:
        extra: list = []  # conjuncts added to allOf

        fmt = node.get("format")
        if fmt is not None and fmt not in KNOWN_FORMATS:
            del node["format"]
            if fmt in FORMAT_ALIASES:
                node["format"] = FORMAT_ALIASES[fmt]
                self.note(path, f"format {fmt!r}: only its ASCII subset is accepted")
            elif fmt in FORMAT_PATTERNS or fmt in REFERENCE_FORMATS:
                if fmt in REFERENCE_FORMATS:
                    # an absolute URI (llguidance's 'uri') or a relative reference
                    rx = {"anyOf": [{"format": "uri"}, {"pattern": "^" + RELATIVE_REF + "$"}]}
                    alt = {"type": [t for t in TYPES if t != "string"]}
                    extra.append({"anyOf": [alt, {"type": "string", **rx}]})
                else:
                    extra.append({"pattern": FORMAT_PATTERNS[fmt]})
            else:
                self.note(path, f"format {fmt!r} dropped (not a JSON Schema format: validators "
                                "do not assert it)")

        if isinstance(node.get("pattern"), str):
            parts = rewrite_pattern(node["pattern"])
            if parts is False:
                # no string matches: only the schema's other types remain
                self.note(path, "pattern matches no string (an anchor that cannot hold)")
                del node["pattern"]
                types = type_set(node.get("type", list(TYPES))) - {"string"}
                if not types:
                    return False
                node["type"] = [t for t in TYPES if t in types]
            elif parts:
                node["pattern"] = parts[0]
                extra.extend({"pattern": p} for p in parts[1:])

        if node.get("uniqueItems") is not True:
            node.pop("uniqueItems", None)
        else:
            del node["uniqueItems"]
            if not (self._unique_literal_items(node) or self._single_valued_items(node)):
                mx = node.get("maxItems")
                if not (isinstance(mx, (int, float)) and mx <= 1):
                    node["maxItems"] = 1
                    self.note(path, "uniqueItems: arrays limited to one item")

        if "contains" in node:
            self._rewrite_contains(node, path)

        if "not" in node:
            neg = self.neg(node.pop("not"), 0)
            if neg is None:
                self.note(path, "'not' has no expressible complement: nothing matches here")
                neg = False
            extra.append(neg)

        if "if" in node or "then" in node or "else" in node:
            cond = node.pop("if", True)
            then = node.pop("then", True)
            els = node.pop("else", True)
            if cond is True or cond == {}:
                extra.append(as_schema(then))
            elif cond is False:
                extra.append(as_schema(els))
            else:
                ncond = self.neg(cond, 0)
                if ncond is None:
                    self.note(path, "if/then/else: the complement of 'if' is not expressible; "
                                    "only instances matching 'if' and 'then' are accepted")
                    branches = [all_of([as_schema(cond), as_schema(then)])]
                else:
                    branches = [all_of([as_schema(cond), as_schema(then)]), all_of([ncond, as_schema(els)])]
                extra.append(any_of(branches))

        deps = {}
        if isinstance(node.get("dependencies"), dict):
            deps.update(node.pop("dependencies"))
        if isinstance(node.get("dependentRequired"), dict):
            deps.update(node.pop("dependentRequired"))
        if isinstance(node.get("dependentSchemas"), dict):
            for k, v in node.pop("dependentSchemas").items():
                deps[k] = v if k not in deps else all_of([deps[k], v])
        for prop, dep in deps.items():
            absent = {"properties": {prop: False}}
            if isinstance(dep, list):
                present = {"required": [prop] + [d for d in dep if d != prop]}
            else:
                present = all_of([{"required": [prop]}, as_schema(dep)])
            extra.append(any_of([absent, present]))

        if "oneOf" in node:
            extra.append(self._rewrite_one_of(node.pop("oneOf"), path, node.get("type")))

        if node.get("unevaluatedProperties") is not None:
            up = node.pop("unevaluatedProperties")
            if up is not True and up != {}:
                if "additionalProperties" not in node:
                    node["additionalProperties"] = up
                    self.note(path, "unevaluatedProperties treated as additionalProperties")
        if node.get("unevaluatedItems") is not None:
            ui = node.pop("unevaluatedItems")
            if ui is not True and ui != {}:
                if "items" not in node or isinstance(node.get("items"), list):
                    key = "additionalItems" if isinstance(node.get("items"), list) else "items"
                    node.setdefault(key, ui)
                    self.note(path, "unevaluatedItems treated as items")

        self._literal_pattern_properties(node)

        if "propertyNames" in node:
            self._rewrite_property_names(node, path)

        for k in ("minContains", "maxContains"):
            node.pop(k, None)

        self._rewrite_min_max_properties(node, path)

        if extra:
            extra = [e if e is not True else {} for e in extra]
            if any(e is False for e in extra):
                return False
            extra = [e for e in extra if e != {}]
            if not extra:
                return node
            split = self._split_dependency(node, extra)
            if split is not None:
                return split
            # keep the rewritten schema flat: llguidance refuses recursive refs under an
            # intersection ("circular references with sibling keys")
            if not node and len(extra) == 1:
                return extra[0]
            if (len(extra) == 1 and isinstance(extra[0], dict) and set(extra[0]) == {"anyOf"}
                    and "anyOf" not in node):
                node = dict(node)
                node["anyOf"] = extra[0]["anyOf"]
                return self._simplify(node)
            node = dict(node)
            allof = list(node.get("allOf", []))
            allof.extend(e if e is not True else {} for e in extra)
            if any(a is False for a in allof):
                return False
            node["allOf"] = [a for a in allof if a != {}] or [{}]
        return self._simplify(node)
