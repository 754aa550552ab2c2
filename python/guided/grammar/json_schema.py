"""JSON Schema → one llguidance grammar entry: sanitising and the whitespace policy.

``json_schema_grammar(schema, whitespace=None)`` returns ``{"json_schema": ...}``,
which the grammar composer embeds as one entry of ``{"grammars": [...]}``.

Sanitising
----------
llguidance's JSON compiler refuses a number of JSON Schema keywords. Instead of
failing the request (or, worse, ignoring them as its ``lenient`` option does,
which lets through instances that break the schema), we rewrite the schema into
one llguidance accepts whose set of accepted instances is **the same or a
subset** of the original's. Never a superset: an instance the engine lets
through always validates against the client's schema.

* Annotations that do not constrain values are dropped (title, description,
  examples, $comment, default, deprecated, readOnly, writeOnly, ...), as are
  the client's own ``x-guidance`` options (they could relax the grammar).
* ``format`` values llguidance does not know are dropped: JSON Schema treats an
  unknown format as an annotation, and validators do not assert it.
* ``not S`` becomes a schema for (a subset of) the complement of S, built by
  De Morgan over S's keywords (types, enum/const, required, properties, ranges,
  lengths, anyOf/allOf, $ref). Parts that have no expressible complement
  (patterns, multipleOf, ...) are left out, which only narrows the result.
* ``oneOf`` becomes ``anyOf`` when its options are provably disjoint (types,
  const/enum values, required discriminator properties); otherwise each option
  is intersected with the complements of the options it may overlap.
* ``if/then/else`` becomes ``(if ∧ then) ∨ (¬if ∧ else)``; ``dependencies``,
  ``dependentRequired`` and ``dependentSchemas`` become ``¬has(p) ∨ (...)``.
* ``contains`` is exact when every allowed item satisfies it (then it only
  means ``minItems ≥ 1``); otherwise the first item must satisfy it (subset).
* ``uniqueItems: true`` keeps exactly-one-value arrays exact and otherwise
  caps the array at one item (subset; a note is logged).
* ``minProperties``/``maxProperties`` that llguidance cannot handle are
  rewritten when exact (enough required or listed properties) or narrowed.
* ``unevaluatedProperties: false`` becomes ``additionalProperties: false``
  (subset), ``propertyNames`` is applied to the listed properties when no
  other property may appear.

Every dropped or narrowed constraint is logged (logger ``guided.grammar``) and
listed by ``sanitize_json_schema``.

Whitespace policy
-----------------
Unbounded whitespace lets a model that likes newlines pad a JSON value until
max_tokens. The default (``whitespace=None``) allows, between any two JSON
tokens, at most one whitespace run of either up to 8 spaces/tabs, or one
newline (optionally ``\\r\\n``) followed by up to 32 spaces/tabs of indentation.
Compact JSON and ``json.dumps(obj, indent=2 or 4)`` (up to 8 levels at 4, 16
at 2) are accepted; blank lines and runs of spaces are not, so whitespace per
position is bounded. Separators are ``,`` and ``:`` with the run around them.

``whitespace`` overrides it per request: ``"compact"`` (no whitespace at all),
``"flexible"`` (llguidance's default: any run of JSON whitespace) or any other
string, used as the regex of one whitespace run.
"""
from __future__ import annotations

import copy
import itertools
import json
import logging
import math
from typing import Any

log = logging.getLogger("guided.grammar")

#: the default whitespace run between JSON tokens (see the module docstring)
# 32, not more: each tab is a token of its own, so the bound is also how many
# tokens a whitespace-loving model can spend per position.
BOUNDED_WHITESPACE = r"[\x20\x09]{1,8}|\r?\n[\x20\x09]{0,32}"

# Formats llguidance 1.9 implements (src/json/formats.rs); others are annotations.
_KNOWN_FORMATS = frozenset({
    "date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
    "unknown",
})

# Keywords with no effect on which instances validate.
_ANNOTATIONS = frozenset({
    "title", "description", "examples", "example", "$comment", "default", "deprecated",
    "readOnly", "writeOnly", "contentMediaType", "contentEncoding", "contentSchema",
    "x-guidance", "discriminator", "nullable_note", "markdownDescription", "errorMessage",
    "enumDescriptions", "markdownEnumDescriptions", "deprecationMessage", "$vocabulary",
})

_TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
_STRING_KW = ("minLength", "maxLength", "pattern", "format")
_NUMBER_KW = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_ARRAY_KW = ("items", "prefixItems", "additionalItems", "minItems", "maxItems", "contains",
             "uniqueItems", "minContains", "maxContains")
_OBJECT_KW = ("properties", "patternProperties", "additionalProperties", "required",
              "minProperties", "maxProperties", "propertyNames", "dependencies",
              "dependentRequired", "dependentSchemas")

_MAX_NEG_DEPTH = 6
_MAX_COMBINATIONS = 64
_MAX_STEPS = 200_000  # sub-schemas visited while rewriting one schema


class _Unsupported(Exception):
    pass


def json_schema_grammar(schema: dict | bool, whitespace: str | None = None) -> dict:
    """One llguidance grammar entry for ``schema``: ``{"json_schema": sanitized}``.

    ``whitespace``: None (bounded, the default), "compact", "flexible", or a
    regex for one whitespace run. Raises ValueError on a schema that is not a
    JSON object/boolean.
    """
    sanitized, notes = sanitize_json_schema(schema)
    for note in notes:
        log.info("json schema: %s", note)
    if sanitized is True:
        sanitized = {}
    elif sanitized is False:
        raise ValueError("the JSON schema accepts no instance (after rewriting: "
                         + "; ".join(notes[-3:]) + ")")
    sanitized["x-guidance"] = whitespace_options(whitespace)
    return {"json_schema": sanitized}


def whitespace_options(whitespace: str | None = None) -> dict:
    """llguidance JSON options (``x-guidance``) for a whitespace policy."""
    opts: dict[str, Any] = {"item_separator": ",", "key_separator": ":", "lenient": False,
                            "coerce_one_of": False}
    if whitespace is None or whitespace == "bounded":
        opts.update(whitespace_flexible=False, whitespace_pattern=BOUNDED_WHITESPACE)
    elif whitespace == "compact":
        opts.update(whitespace_flexible=False)
    elif whitespace == "flexible":
        opts.update(whitespace_flexible=True)
    elif isinstance(whitespace, str) and whitespace:
        opts.update(whitespace_flexible=False, whitespace_pattern=whitespace)
    else:
        raise ValueError(f"whitespace must be 'compact', 'flexible' or a regex, not {whitespace!r}")
    return opts


def sanitize_json_schema(schema: dict | bool) -> tuple[dict | bool, list[str]]:
    """(an equivalent or narrower schema llguidance accepts, notes on what was narrowed)."""
    if not isinstance(schema, (dict, bool)):
        raise ValueError("a JSON schema must be an object or a boolean")
    s = _Sanitizer(copy.deepcopy(schema))
    out = s.run()
    return out, s.notes


# --------------------------------------------------------------------------------------------

def _canon(v: Any) -> str:
    """A canonical key for a JSON value (1 and 1.0 are the same number)."""
    def norm(x):
        if isinstance(x, bool) or x is None or isinstance(x, str):
            return x
        if isinstance(x, float) and x.is_integer():
            return int(x)
        if isinstance(x, dict):
            return {k: norm(x[k]) for k in sorted(x)}
        if isinstance(x, list):
            return [norm(i) for i in x]
        return x
    return json.dumps(norm(v), sort_keys=True)


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _any_of(options: list) -> Any:
    """anyOf over options, simplified (True absorbs, False vanishes)."""
    opts = [o for o in options if o is not False and o != {"enum": []}]
    if any(o is True or o == {} for o in opts):
        return True
    if not opts:
        return False
    if len(opts) == 1:
        return opts[0]
    return {"anyOf": opts}


def _all_of(options: list) -> Any:
    opts = [o for o in options if o is not True and o != {}]
    if any(o is False for o in opts):
        return False
    if not opts:
        return True
    if len(opts) == 1:
        return opts[0]
    return {"allOf": opts}


def _schema(x: Any) -> Any:
    """Booleans as schemas llguidance takes everywhere."""
    if x is True:
        return {}
    if x is False:
        return False
    return x


_ROOT_URI = "https://root.invalid/schema.json"

_DRAFTS = {
    "http://json-schema.org/draft-04/schema": 4,
    "http://json-schema.org/draft-06/schema": 6,
    "http://json-schema.org/draft-07/schema": 7,
    "https://json-schema.org/draft/2019-09/schema": 2019,
    "https://json-schema.org/draft/2020-12/schema": 2020,
}

# Keywords each draft knows (validators ignore the others, so we drop them).
_COMMON_KW = frozenset({
    "$ref", "$schema", "additionalItems", "additionalProperties", "allOf", "anyOf", "dependencies",
    "enum", "exclusiveMaximum", "exclusiveMinimum", "format", "items", "maxItems", "maxLength",
    "maxProperties", "maximum", "minItems", "minLength", "minProperties", "minimum", "multipleOf",
    "not", "oneOf", "pattern", "patternProperties", "properties", "required", "type", "uniqueItems",
    "definitions",
})
_KW_SINCE = {
    "const": 6, "contains": 6, "propertyNames": 6, "$id": 6, "if": 7, "then": 7, "else": 7,
    "$defs": 2019, "$anchor": 2019, "dependentRequired": 2019, "dependentSchemas": 2019,
    "maxContains": 2019, "minContains": 2019, "prefixItems": 2020, "unevaluatedItems": 2019,
    "unevaluatedProperties": 2019,
}

# Formats JSON Schema defines that llguidance lacks: a regex for (a subset of) each.
_PCHAR = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|%[0-9A-Fa-f]{2})"
_SEG_NC = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=@]|%[0-9A-Fa-f]{2})"
_QUERY = r"(?:" + _PCHAR + r"|[/?])*"
_RELATIVE_REF = (r"(?:/(?:" + _PCHAR + r"+(?:/" + _PCHAR + r"*)*)?|" + _SEG_NC + r"+(?:/" + _PCHAR
                 + r"*)*)?(?:\?" + _QUERY + r")?(?:#" + _QUERY + r")?")
_TPL_LIT = r"(?:[!#$&()*+,\-./0-9:;=?@A-Z\[\]_a-z~]|%[0-9A-Fa-f]{2})"
_TPL_VARCHAR = r"(?:[A-Za-z0-9_]|%[0-9A-Fa-f]{2})"
_TPL_VARSPEC = _TPL_VARCHAR + r"(?:\.?" + _TPL_VARCHAR + r")*(?::[1-9][0-9]{0,3}|\*)?"
_FORMAT_PATTERNS = {
    "uri-template": r"^(?:" + _TPL_LIT + r"|\{[+#./;?&=,!@|]?" + _TPL_VARSPEC + r"(?:," + _TPL_VARSPEC
                    + r")*\})*$",
    "json-pointer": r"^(?:/(?:[^/~]|~[01])*)*$",
    "relative-json-pointer": r"^(?:0|[1-9][0-9]*)(?:#|(?:/(?:[^/~]|~[01])*)*)$",
    "regex": r"^(?:[^\\^$|?*+()\[\]{}]|\\[\\^$.|?*+()\[\]{}/dDwWsS])*$",
}
_FORMAT_ALIASES = {  # a subset of the named format that llguidance implements
    "idn-email": "email", "idn-hostname": "hostname", "iri": "uri",
}
_REFERENCE_FORMATS = {"uri-reference", "iri-reference"}
_STANDARD_FORMATS = (_KNOWN_FORMATS | set(_FORMAT_PATTERNS) | set(_FORMAT_ALIASES)
                     | _REFERENCE_FORMATS)


def _esc(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


class _Ctx:
    """Where a sub-schema sits: its draft and base URI."""
    __slots__ = ("draft", "base")

    def __init__(self, draft: int, base: str):
        self.draft, self.base = draft, base


def _join(base: str, ref: str) -> str:
    from urllib.parse import urljoin
    if ref.startswith("json-schema:///"):  # llguidance's default base
        ref = ref[len("json-schema:///"):]
    return urljoin(base, ref)


class _Sanitizer:
    def __init__(self, root: Any):
        self.root = root
        self.notes: list[str] = []
        self._neg_walks = 0  # nesting of walks started by neg() (refs can be recursive)
        self.resources: dict[str, tuple[Any, _Ctx]] = {}   # absolute URI → (node, ctx)
        self.anchors: dict[str, Any] = {}                   # URI#name → node
        self.ctx: dict[int, _Ctx] = {}                      # id(node) → ctx
        self.defs: dict[str, Any] = {}                      # output $defs
        self.def_names: dict[int, str] = {}                 # id(target) → name in $defs
        self.queue: list[tuple[Any, _Ctx, str]] = []
        self.in_progress: set[str] = set()
        self.def_nodes: dict[str, Any] = {}
        self.steps = 0

    # ---- references -------------------------------------------------------------------

    def run(self):
        root = self.root
        if isinstance(root, bool):
            return root
        ctx = self._index(root, _Ctx(2020, _ROOT_URI), top=True)
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
        if isinstance(out, dict) and self.defs:
            out = dict(out)
            out["$defs"] = self.defs
        elif self.defs and out is not False:
            out = {"allOf": [out if out is not True else {}], "$defs": self.defs}
        return out

    def _node_ctx(self, node: dict, ctx: _Ctx) -> _Ctx:
        draft, base = ctx.draft, ctx.base
        sch = node.get("$schema")
        if isinstance(sch, str):
            draft = _DRAFTS.get(sch.rstrip("#").replace("https://json-schema.org/draft-0",
                                                         "http://json-schema.org/draft-0"), 2020)
        nid = node.get("id") if draft == 4 else node.get("$id")
        if isinstance(nid, str) and nid and not (draft >= 2019 and nid.startswith("#")):
            if nid.startswith("#"):
                self.anchors[_join(base, nid)] = node
            else:
                base = _join(base, nid).split("#")[0]
        if draft == draft and (draft, base) == (ctx.draft, ctx.base):
            return ctx
        return _Ctx(draft, base)

    def _index(self, node: Any, ctx: _Ctx, top: bool = False) -> _Ctx:
        """Record every sub-schema's draft and base URI, resources and anchors."""
        if not isinstance(node, dict):
            return ctx
        nctx = self._node_ctx(node, ctx)
        self.ctx[id(node)] = nctx
        if top or nctx.base != ctx.base:
            self.resources.setdefault(nctx.base, (node, nctx))
        if top:
            self.resources.setdefault(_ROOT_URI, (node, nctx))
        if isinstance(node.get("$anchor"), str):
            self.anchors[nctx.base + "#" + node["$anchor"]] = node
        for k, v in node.items():
            if k in ("enum", "const", "examples", "default"):
                continue
            if k in ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas",
                     "dependencies"):
                if isinstance(v, dict):
                    for sub in v.values():
                        self._index(sub, nctx)
            elif isinstance(v, dict):
                self._index(v, nctx)
            elif isinstance(v, list):
                for sub in v:
                    self._index(sub, nctx)
        return nctx

    def target(self, ref: str, ctx: _Ctx) -> tuple[Any, _Ctx]:
        """The (original) schema a ref points at and its context, or raise _Unsupported."""
        from urllib.parse import unquote
        absolute = _join(ctx.base, ref)
        doc, _, frag = absolute.partition("#")
        if doc not in self.resources:
            raise _Unsupported(f"$ref {ref!r} points outside the schema")
        node, rctx = self.resources[doc]
        frag = unquote(frag)
        if frag in ("", "/"):
            return node, rctx
        if not frag.startswith("/"):
            found = self.anchors.get(doc + "#" + frag)
            if found is None:
                raise _Unsupported(f"$ref {ref!r}: no such anchor")
            return found, self.ctx.get(id(found), rctx)
        for part in frag[1:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise _Unsupported(f"$ref {ref!r} does not resolve")
        return node, self.ctx.get(id(node), rctx)

    def ref_name(self, ref: str, ctx: _Ctx) -> str:
        node, tctx = self.target(ref, ctx)
        key = id(node)
        if key not in self.def_names:
            name = f"r{len(self.def_names)}"
            self.def_names[key] = name
            self.def_nodes[name] = node
            self.queue.append((node, tctx, name))
        return self.def_names[key]

    def resolve(self, ref: str) -> Any:
        """The sanitised schema a rewritten ref ("#/$defs/rN") points at (walked on first use;
        _Unsupported while it is still being walked, i.e. for a recursive reference)."""
        if ref.startswith("#/$defs/"):
            name = ref[len("#/$defs/"):]
            if name in self.defs:
                return self.defs[name]
            if name in self.in_progress:
                raise _Unsupported("recursive reference")
            for i, (node, nctx, qname) in enumerate(self.queue):
                if qname == name:
                    del self.queue[i]
                    return self._walk_def(node, nctx, name)
        raise _Unsupported(f"$ref {ref!r} unknown")

    def _walk_def(self, node, ctx, name):
        self.in_progress.add(name)
        try:
            self.defs[name] = self.walk(node, f"#(ref {name})", ctx)
        finally:
            self.in_progress.discard(name)
        return self.defs[name]

    # ---- the walk -----------------------------------------------------------------------

    def note(self, path: str, msg: str):
        self.notes.append(f"{path}: {msg}")

    def walk(self, node: Any, path: str, ctx: _Ctx | None = None) -> Any:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            # not a schema: leave it to llguidance to reject
            return node
        self.steps += 1
        if self.steps > _MAX_STEPS:
            raise ValueError("the JSON schema is too complex to rewrite")
        ctx = self.ctx.get(id(node)) or self._node_ctx(node, ctx or _Ctx(2020, _ROOT_URI))
        draft = ctx.draft
        out = {}
        for k, v in node.items():
            if k in _ANNOTATIONS or k in ("$schema", "$id", "id", "$anchor", "definitions", "$defs",
                                          "$dynamicAnchor", "$recursiveAnchor"):
                continue
            since = _KW_SINCE.get(k)
            if since is not None and draft < since:
                continue  # not a keyword in this draft: validators ignore it
            out[k] = v
        node = out
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
                node[k] = {n: self.walk(v, f"{path}/{k}/{_esc(n)}", ctx) for n, v in node[k].items()}
        for k in ("additionalProperties", "contains", "not", "if", "then", "items",
                  "else", "propertyNames", "unevaluatedProperties", "unevaluatedItems"):
            if k in node and isinstance(node[k], (dict, bool)):
                node[k] = self.walk(node[k], f"{path}/{k}", ctx)
        for k in ("anyOf", "allOf", "oneOf", "prefixItems"):
            if isinstance(node.get(k), list):
                node[k] = [self.walk(v, f"{path}/{k}/{i}", ctx) for i, v in enumerate(node[k])]
        if isinstance(node.get("dependencies"), dict):
            node["dependencies"] = {n: (self.walk(v, f"{path}/dependencies/{_esc(n)}", ctx)
                                        if isinstance(v, (dict, bool)) else v)
                                    for n, v in node["dependencies"].items()}
        ref = node.get("$ref")
        if isinstance(ref, str):
            try:
                node["$ref"] = "#/$defs/" + self.ref_name(ref, ctx)
            except _Unsupported as e:
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
        if fmt is not None and fmt not in _KNOWN_FORMATS:
            del node["format"]
            if fmt in _FORMAT_ALIASES:
                node["format"] = _FORMAT_ALIASES[fmt]
                self.note(path, f"format {fmt!r}: only its ASCII subset is accepted")
            elif fmt in _FORMAT_PATTERNS or fmt in _REFERENCE_FORMATS:
                if fmt in _REFERENCE_FORMATS:
                    # an absolute URI (llguidance's 'uri') or a relative reference
                    rx = {"anyOf": [{"format": "uri"}, {"pattern": "^" + _RELATIVE_REF + "$"}]}
                    alt = {"type": [t for t in _TYPES if t != "string"]}
                    extra.append({"anyOf": [alt, {"type": "string", **rx}]})
                else:
                    extra.append({"pattern": _FORMAT_PATTERNS[fmt]})
            else:
                self.note(path, f"format {fmt!r} dropped (not a JSON Schema format: validators "
                                "do not assert it)")

        if node.get("uniqueItems") is not True:
            node.pop("uniqueItems", None)
        else:
            del node["uniqueItems"]
            if not self._single_valued_items(node):
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
                extra.append(_schema(then))
            elif cond is False:
                extra.append(_schema(els))
            else:
                ncond = self.neg(cond, 0)
                if ncond is None:
                    self.note(path, "if/then/else: the complement of 'if' is not expressible; "
                                    "only instances matching 'if' and 'then' are accepted")
                    branches = [_all_of([_schema(cond), _schema(then)])]
                else:
                    branches = [_all_of([_schema(cond), _schema(then)]), _all_of([ncond, _schema(els)])]
                extra.append(_any_of(branches))

        deps = {}
        if isinstance(node.get("dependencies"), dict):
            deps.update(node.pop("dependencies"))
        if isinstance(node.get("dependentRequired"), dict):
            deps.update(node.pop("dependentRequired"))
        if isinstance(node.get("dependentSchemas"), dict):
            for k, v in node.pop("dependentSchemas").items():
                deps[k] = v if k not in deps else _all_of([deps[k], v])
        for prop, dep in deps.items():
            absent = {"properties": {prop: False}}
            if isinstance(dep, list):
                present = {"required": [prop] + [d for d in dep if d != prop]}
            else:
                present = _all_of([{"required": [prop]}, _schema(dep)])
            extra.append(_any_of([absent, present]))

        if "oneOf" in node:
            extra.append(self._rewrite_one_of(node.pop("oneOf"), path))

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
        ts = self._type_set(node["type"])
        opts = []
        for o in node["anyOf"]:
            if isinstance(o, dict) and set(o) == {"$ref"} and o["$ref"].startswith("#/$defs/"):
                name = o["$ref"][len("#/$defs/"):]
                d = self.defs.get(name)
                if not isinstance(d, dict) or any(k in d for k in ("anyOf", "allOf", "oneOf", "$ref")):
                    return node
                t = ts if "type" not in d else ts & self._type_set(d["type"])
                if not t:
                    continue
                tname = f"{name}_{'_'.join(sorted(t))}"
                if tname not in self.defs:
                    self.defs[tname] = {**d, "type": sorted(t)}
                opts.append({"$ref": "#/$defs/" + tname})
            elif isinstance(o, dict) and not any(k in o for k in ("anyOf", "allOf", "oneOf", "$ref")):
                t = ts if "type" not in o else ts & self._type_set(o["type"])
                if t:
                    opts.append({**o, "type": sorted(t)})
            else:
                return node
        return _any_of(opts) if opts else False

    def _simplify(self, node: Any) -> Any:
        """{"type": T, "anyOf": [...]} with options of known types: drop the type (recursive
        refs under an intersection are refused by llguidance) or the options it excludes."""
        if not (isinstance(node, dict) and set(node) == {"type", "anyOf"}
                and isinstance(node["anyOf"], list)):
            return node
        ts = self._type_set(node["type"])
        keep = []
        for o in node["anyOf"]:
            to = self.types(o, 0)
            if to is None or not to <= ts:
                if to is not None and not (to & ts):
                    continue  # excluded by the type
                return node
            keep.append(o)
        return _any_of(keep) if keep else False

    # ---- individual keywords --------------------------------------------------------------

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
            entry = _all_of([_schema(base), _schema(contains)])
            if i < len(prefix):
                prefix[i] = entry
            else:
                prefix.append(entry)
        node["prefixItems"] = prefix
        node["minItems"] = max(node.get("minItems", 0), min_c)

    def _implies(self, a: Any, b: Any) -> bool:
        """Whether every instance of a is an instance of b (conservative)."""
        if b is True or b == {}:
            return True
        if _canon(a) == _canon(b):
            return True
        if isinstance(b, dict) and set(b) == {"type"} and isinstance(a, dict):
            ta = self.types(a, 0)
            tb = self._type_set(b["type"])
            return ta is not None and ta <= tb
        return False

    def _rewrite_property_names(self, node: dict, path: str):
        pn = node.pop("propertyNames")
        if pn is True or pn == {}:
            return
        ap = node.get("additionalProperties", True)
        props = node.get("properties", {})
        if (ap is False or ap == {"not": {}}) and not node.get("patternProperties"):
            # only the listed names can appear: forbid those that break propertyNames
            if isinstance(pn, dict) and set(pn) <= {"type", "enum", "const", "minLength", "maxLength"}:
                import re as _re  # noqa: F401
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

    def _string_matches(self, pn: Any, name: str) -> bool:
        """Conservative: False unless name surely satisfies pn."""
        if pn is True or pn == {}:
            return True
        if not isinstance(pn, dict):
            return False
        for k, v in pn.items():
            if k == "type":
                if "string" not in self._type_set(v):
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
            elif k in _ANNOTATIONS or k == "format":
                continue
            else:
                return False
        return True

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
                                               _MAX_COMBINATIONS + 1))
                if need <= len(optional) and combos and len(combos) <= _MAX_COMBINATIONS:
                    node.pop("minProperties")
                    branch = _any_of([{"required": list(c)} for c in combos])
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
                                               _MAX_COMBINATIONS + 1))
                if len(combos) <= _MAX_COMBINATIONS:
                    node.pop("maxProperties")
                    node.setdefault("allOf", []).append(_any_of([
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

    def _rewrite_one_of(self, options: list, path: str) -> Any:
        opts = [_schema(o) for o in options]
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
                branches.append(_all_of(parts))
            else:
                dropped += 1
        if dropped:
            self.note(path, f"oneOf: {dropped} of {n} options that may overlap others are not "
                            "allowed (narrower)")
        return _any_of(branches) if branches else False

    # ---- analysis ---------------------------------------------------------------------------

    @staticmethod
    def _type_only(s: Any) -> bool:
        if isinstance(s, dict):
            if set(s) == {"type"}:
                return True
            if set(s) == {"anyOf"}:
                return all(_Sanitizer._type_only(o) for o in s["anyOf"])
        return False

    def _strings(self, s: Any, depth: int = 0):
        """(patterns, finite string values or None) that a string schema imposes."""
        s = self.deref(s, depth)
        pats: list[str] = []
        vals = None
        if not isinstance(s, dict) or depth > _MAX_NEG_DEPTH:
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
                if all(any(not _search(p, v) for p in pats) for v in vals):
                    return True
        for x in pa:
            fx = _first_chars(x)
            if fx is None:
                continue
            for y in pb:
                fy = _first_chars(y)
                if fy is not None and not (fx & fy):
                    return True
        return False

    def _type_set(self, t: Any) -> set[str]:
        ts = set(t) if isinstance(t, list) else {t}
        if "number" in ts:
            ts.add("integer")
        return ts

    def deref(self, s: Any, depth: int) -> Any:
        while isinstance(s, dict) and "$ref" in s and depth < _MAX_NEG_DEPTH:
            try:
                target = self.resolve(s["$ref"])
            except _Unsupported:
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
        if depth > _MAX_NEG_DEPTH:
            return None
        ref = s.get("$ref") if isinstance(s, dict) else None
        s = self.deref(s, depth)
        if s is None and isinstance(ref, str) and ref.startswith("#/$defs/"):
            # a reference still being rewritten (recursion): its own 'type' bounds it
            raw = self.def_nodes.get(ref[len("#/$defs/"):])
            if isinstance(raw, dict) and isinstance(raw.get("type"), (str, list)):
                return self._type_set(raw["type"])
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
            meet(self._type_set(s["type"]))
        if "const" in s:
            meet(self._type_set(_json_type(s["const"])))
        if isinstance(s.get("enum"), list):
            ts = set()
            for v in s["enum"]:
                ts |= self._type_set(_json_type(v))
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
        if not isinstance(s, dict) or depth > _MAX_NEG_DEPTH:
            return None
        vals = None
        if "const" in s:
            vals = {_canon(s["const"])}
        if isinstance(s.get("enum"), list):
            e = {_canon(v) for v in s["enum"]}
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
        if isinstance(s.get("allOf"), list) and depth < _MAX_NEG_DEPTH:
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
        """True only if no instance satisfies both a and b."""
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
        if ta is not None and tb is not None and common <= {"string"}:
            if self._strings_disjoint(a, b):
                return True
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

    # ---- complement -------------------------------------------------------------------------

    def neg(self, s: Any, depth: int) -> Any:
        """A schema for a subset of the complement of s (None: nothing expressible)."""
        if depth > _MAX_NEG_DEPTH:
            return None
        if s is True or s == {}:
            return False
        if s is False:
            return True
        if not isinstance(s, dict):
            return None
        if "$ref" in s:
            try:
                target = self.resolve(s["$ref"])
            except _Unsupported:
                return None
            rest = {k: v for k, v in s.items() if k != "$ref"}
            parts = [self.neg(target, depth + 1)]
            if rest:
                parts.append(self.neg(rest, depth + 1))
            got = [p for p in parts if p is not None]
            return _any_of(got) if got else None
        s = {k: v for k, v in s.items() if k not in _ANNOTATIONS and k not in (
            "$schema", "$id", "id", "definitions", "$defs", "$anchor")}
        if not s:
            return False
        ts = self._type_set(s["type"]) if "type" in s else None
        parts: list = []  # each a schema for instances that break one conjunct
        complete = True

        def add(x):
            nonlocal complete
            if x is None:
                complete = False
            else:
                parts.append(x)

        if ts is not None:
            others = [t for t in _TYPES if t not in ts]
            if "integer" in ts and "number" not in ts:
                others = [t for t in others if t != "number"]  # non-integral numbers: not expressible
                complete = False
            add({"type": others} if others else False)

        def typed(t: str, body: dict) -> dict | None:
            if ts is None or t in ts:
                return {"type": t, **body}
            if t == "number" and "integer" in ts:
                return {"type": "integer", **body}
            return None  # the keyword is vacuous for s's types: nothing to complement

        if "const" in s or "enum" in s:
            vals = [s["const"]] if "const" in s else list(s.get("enum") or [])
            add(self._neg_values(vals))
        if "minLength" in s and s["minLength"] > 0:
            add(typed("string", {"maxLength": int(math.ceil(s["minLength"])) - 1}))
        if "maxLength" in s:
            add(typed("string", {"minLength": int(math.floor(s["maxLength"])) + 1}))
        for k in ("pattern", "format"):
            if k in s:
                add(None)
        if "minimum" in s and isinstance(s["minimum"], (int, float)):
            if s.get("exclusiveMinimum") is True:
                add(typed("number", {"maximum": s["minimum"]}))
            else:
                add(typed("number", {"exclusiveMaximum": s["minimum"]}))
        if "maximum" in s and isinstance(s["maximum"], (int, float)):
            if s.get("exclusiveMaximum") is True:
                add(typed("number", {"minimum": s["maximum"]}))
            else:
                add(typed("number", {"exclusiveMinimum": s["maximum"]}))
        if isinstance(s.get("exclusiveMinimum"), (int, float)) and not isinstance(s.get("exclusiveMinimum"), bool):
            add(typed("number", {"maximum": s["exclusiveMinimum"]}))
        if isinstance(s.get("exclusiveMaximum"), (int, float)) and not isinstance(s.get("exclusiveMaximum"), bool):
            add(typed("number", {"minimum": s["exclusiveMaximum"]}))
        if "multipleOf" in s:
            add(None)
        if "minItems" in s and s["minItems"] > 0:
            add(typed("array", {"maxItems": int(s["minItems"]) - 1}))
        if "maxItems" in s:
            add(typed("array", {"minItems": int(s["maxItems"]) + 1}))
        if isinstance(s.get("items"), dict) and "prefixItems" not in s:
            # an array whose first item breaks 'items' (a subset of those with any such item)
            n = self.neg(s["items"], depth + 1)
            if n is not None and n is not False:
                add(typed("array", {"minItems": 1, "prefixItems": [n]}))
            else:
                add(None)
        for k in ("items", "prefixItems", "additionalItems", "contains", "uniqueItems"):
            if k == "items" and isinstance(s.get("items"), dict) and "prefixItems" not in s:
                continue
            if k in s and s[k] not in (True, {}, False) and not (k == "uniqueItems" and s[k] is False):
                add(None)
            elif k in ("items", "additionalItems") and s.get(k) is False:
                add(None)
        if isinstance(s.get("required"), list):
            for p in s["required"]:
                # non-objects satisfy 'required', so only objects can break it: an
                # untyped {"properties": {p: false}} would also admit every non-object
                if ts is None or "object" in ts:
                    add({"type": "object", "properties": {p: False}})
        if isinstance(s.get("properties"), dict):
            for p, sub in s["properties"].items():
                n = self.neg(sub, depth + 1)
                if n is None:
                    add(None)
                elif n is not False:
                    add(typed("object", {"required": [p], "properties": {p: n}}))
        for k in ("additionalProperties", "patternProperties", "propertyNames", "minProperties",
                  "maxProperties", "dependencies", "dependentRequired", "dependentSchemas",
                  "unevaluatedProperties", "unevaluatedItems", "if", "then", "else"):
            if k in s and s[k] not in (True, {}):
                add(None)
        if isinstance(s.get("anyOf"), list):
            negs = [self.neg(o, depth + 1) for o in s["anyOf"]]
            add(None if any(n is None for n in negs) else _all_of(negs))
        if isinstance(s.get("oneOf"), list):
            # not exactly-one: none of them, or (not expressible) two or more
            negs = [self.neg(o, depth + 1) for o in s["oneOf"]]
            add(None if any(n is None for n in negs) else _all_of(negs))
        if isinstance(s.get("allOf"), list):
            for o in s["allOf"]:
                add(self.neg(o, depth + 1))
        if "not" in s:
            add(s["not"])  # (sanitised schemas keep no 'not'; double negation is exact)
        if not parts:
            return None if not complete else False
        return _any_of(parts)

    def _walk_for_neg(self, node: dict, ctx: _Ctx | None = None) -> Any:
        if self._neg_walks >= _MAX_NEG_DEPTH:
            return None
        self._neg_walks += 1
        n_notes = len(self.notes)
        try:
            return self.walk(node, "#neg", ctx)
        finally:
            self._neg_walks -= 1
            del self.notes[n_notes:]

    def _neg_values(self, vals: list) -> Any:
        """Instances not in a finite set of values (a subset when not expressible exactly)."""
        by_type: dict[str, list] = {}
        for v in vals:
            by_type.setdefault(_json_type(v), []).append(v)
        out = []
        for t in ("null", "boolean", "string", "array", "object"):
            if t not in by_type:
                out.append({"type": t})
        nums = sorted({float(v) for v in by_type.get("integer", []) + by_type.get("number", [])})
        if not nums:
            out.append({"type": "number"})
        elif len(nums) <= 32:
            # every number outside the set lies in one of the open intervals between its values
            bounds = [None] + nums + [None]
            for lo, hi in zip(bounds, bounds[1:]):
                iv: dict = {"type": "number"}
                if lo is not None:
                    iv["exclusiveMinimum"] = int(lo) if lo.is_integer() else lo
                if hi is not None:
                    iv["exclusiveMaximum"] = int(hi) if hi.is_integer() else hi
                out.append(iv)
        if "boolean" in by_type:
            bs = {bool(v) for v in by_type["boolean"]}
            if len(bs) == 1:
                out.append({"const": not bs.pop()})
        if "string" in by_type:
            rx = _complement_strings_regex([v for v in by_type["string"]])
            if rx is not None:
                out.append({"type": "string", "pattern": rx})
        return _any_of(out)


def _rx_escape(ch: str) -> str:
    if ch in "\\^$.|?*+()[]{}-":
        return "\\" + ch
    if ord(ch) < 0x20:
        return "\\x%02x" % ord(ch)
    return ch


def _complement_strings_regex(words: list[str]) -> str | None:
    """An anchored regex for every string not in ``words`` (small sets only)."""
    if len(words) > 64 or sum(len(w) for w in words) > 2000:
        return None
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def alt(node) -> str:
        # strings that start at this trie node and are not words
        options = []
        kids = sorted(k for k in node if k != "")
        if kids:
            cls = "".join(_rx_escape(k) if k not in "]\\^-" else "\\" + k for k in kids)
            options.append(f"[^{cls}][\\s\\S]*")
        else:
            options.append(r"[\s\S]+")
        for k in kids:
            options.append(_rx_escape(k) + "(?:" + alt(node[k]) + ")")
        if "" not in node:
            options.append("")
        return "|".join(options)

    return "^(?:" + alt(trie) + ")$"


def _search(pattern: str, value: str) -> bool:
    """Whether value matches the pattern (True when unsure: Python's re differs from ECMA 262)."""
    import re
    try:
        return re.search(pattern, value) is not None
    except (re.error, RecursionError):
        return True


_CLASS_ESC = {
    "d": set("0123456789"),
    "w": set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"),
}


def _first_chars(pattern: str) -> set[str] | None:
    """The characters a match of an anchored pattern (^...) can start with; None if unknown
    or if it can match the empty string."""
    if not pattern.startswith("^"):
        return None
    alts = _top_level_alternatives(pattern)
    if alts is None or len(alts) > 1:  # then the '^' covers one alternative only
        return None
    return _fc(pattern[1:])


def _top_level_alternatives(rx: str) -> list[str] | None:
    """rx split at its top-level '|' (outside groups, classes and escapes);
    None if a character class is never closed."""
    alts, depth, start, j = [], 0, 0, 0
    while j < len(rx):
        ch = rx[j]
        if ch == "\\":
            j += 2
            continue
        if ch == "[":
            k = rx.find("]", j + 2)
            if k < 0:
                return None
            j = k + 1
            continue
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "|" and depth == 0:
            alts.append(rx[start:j])
            start = j + 1
        j += 1
    alts.append(rx[start:])
    return alts


def _fc(rx: str) -> set[str] | None:
    if not rx:
        return None
    c = rx[0]
    if c in "(":
        depth, i = 0, 0
        while i < len(rx):
            ch = rx[i]
            if ch == "\\":
                i += 2
                continue
            if ch == "[":
                j = rx.find("]", i + 2)
                if j < 0:
                    return None
                i = j + 1
                continue
            if ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
                if depth == 0:
                    break
            i += 1
        else:
            return None
        inner, after = rx[1:i], rx[i + 1:]
        if after[:1] in ("?", "*") or after.startswith("{0"):
            return None
        if inner.startswith("?:"):
            inner = inner[2:]
        elif inner.startswith("?"):
            return None
        alts = _top_level_alternatives(inner)
        if alts is None:
            return None
        out: set[str] = set()
        for a in alts:
            f = _fc(a)
            if f is None:
                return None
            out |= f
        return out
    if c == "\\":
        if len(rx) < 2:
            return None
        e = rx[1]
        atom, rest = (_CLASS_ESC.get(e) if e in _CLASS_ESC else
                      ({e} if not e.isalnum() else None)), rx[2:]
        if atom is None:
            return None
    elif c == "[":
        j = rx.find("]", 2)
        if j < 0 or rx[1] == "^":
            return None
        body, rest = rx[1:j], rx[j + 1:]
        atom = set()
        k = 0
        while k < len(body):
            ch = body[k]
            if ch == "\\":
                if k + 1 >= len(body):
                    return None
                e = body[k + 1]
                if e in _CLASS_ESC:
                    atom |= _CLASS_ESC[e]
                elif not e.isalnum():
                    atom.add(e)
                else:
                    return None
                k += 2
                continue
            if k + 2 < len(body) and body[k + 1] == "-":
                lo, hi = ord(ch), ord(body[k + 2])
                if hi < lo or hi - lo > 256:
                    return None
                atom |= {chr(x) for x in range(lo, hi + 1)}
                k += 3
                continue
            atom.add(ch)
            k += 1
    elif c in ".^$|)*+?{":
        return None
    else:
        atom, rest = {c}, rx[1:]
    if rest[:1] in ("?", "*") or rest.startswith("{0") or rest.startswith("{,"):
        return None
    return atom
