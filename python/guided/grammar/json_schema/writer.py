"""Our own JSON grammar writer: a sanitized schema → one Lark grammar for llguidance.

llguidance's JSON compiler writes an object's listed properties only in the schema's order,
counts every schema node against one size limit (50,000, not settable) and refuses a recursive
$ref beside other keywords. This writer takes over the structure of a schema and hands the rest
to that compiler as ``%json {...}`` leaves:

* an object with listed properties (``required``, ``additionalProperties``, or one
  ``patternProperties`` schema beside additionalProperties false) is a parametric rule of
  llguidance (docs/parametric.md): its 64-bit parameter is the set of listed keys already
  written, so the keys come **in any order, each at most once**, the required ones all present
  (bits 0..r-1 are the required keys: the object may close when they are all set). Additional
  keys may come anywhere after the first key; where keys are required, the first one is a listed
  one (narrower than JSON Schema: a small model that opens an object with a key the schema never
  names wanders; at the root the keys a document often starts with, "$schema", "$id", ..., are
  listed). An additional key's lexeme is a JSON string that is none of the listed names, spelled
  without ``\\u``/``\\/`` escapes, so a listed name cannot come back spelled another way. An
  object with more than 64 listed properties is written in the schema's order;
* each ``$defs`` entry is one rule, so a ``$ref`` is a rule reference: recursion is a rule that
  recurses, and a large schema is split into many leaves, each under the compiler's size limit;
* ``anyOf`` is an alternative; arrays are ``[`` items ``]`` with prefixItems and bounds; a node
  typed object-or-something-else is the object rule or the rest; allOf (and anyOf or $ref beside
  other keywords) is merged into plain schemas where it can be (intersect.py);
* numbers with exponents, and an enum's integral number as ``n.0``, are added beside a number
  leaf where the bounds allow (numbers.py);
* everything else (strings, numbers, enums, intersections it cannot merge) is a leaf compiled by
  llguidance, with the definitions it reaches and property_order's variants. A leaf llguidance
  finds unsatisfiable has no instance: the option or property it stands for is dropped.

Whitespace and separators are the leaves' own (``x-guidance``): the same run is the grammar's
``%ignore`` (once per position, as the JSON compiler skips it), so both lexeme classes agree.
The closing search (rust/grammar/closing.rs) reads the listed keys from the member rules
(``"\\"name\\"" ":" value``) to complete objects without writing additional keys.
"""
from __future__ import annotations

import json
import re
from typing import Any

from .algebra import all_of, node_types, relevant
from .intersect import UNIVERSAL, Intersection, plain_patterns
from .numbers import number_forms
from .oracle import unsatisfiable
from .property_order import METADATA_KEYS, def_refs, in_schema_orders, may_match

_REF = "#/$defs/"
MAX_KEYS = 64          # bits of an llguidance rule parameter
MAX_ARRAY_BOUND = 1024  # larger item bounds stay with the JSON compiler (repeats unrolled here)
OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "patternProperties"}
ARRAY_KEYS = {"type", "items", "prefixItems", "minItems", "maxItems"}
# one JSON string spelling per value (no \\u or \\/ escapes): see the module docstring
_KEY_STRING = r'/"(?:[^"\\\x00-\x1f]|\\["\\bfnrt])*"/'


def _object_part(node: Any) -> bool:
    """Whether node's object instances are ours to write: listed properties (required ones
    among them), additionalProperties any schema, or patternProperties of one schema beside
    additionalProperties false; nothing else that reads an object."""
    if not isinstance(node, dict) or "object" not in node_types(node):
        return False
    props, patterns = node.get("properties", {}), node.get("patternProperties", {})
    if not isinstance(props, dict) or not isinstance(patterns, dict):
        return False
    ap = node.get("additionalProperties", True)
    if not props and not patterns and not (isinstance(ap, dict) and ap):
        return False   # no key has a schema of its own: llguidance's compiler is as good
    required = node.get("required", [])
    if not isinstance(required, list) or any(r not in props or props[r] is False for r in required):
        return False
    if not isinstance(ap, (bool, dict)):
        return False
    if patterns:
        schemas = list(patterns.values())
        if any(x != schemas[0] for x in schemas):
            return False
        if not (len(patterns) == 1 and _universal(next(iter(patterns)))):
            if ap is not False or any(may_match(p, n) for p in patterns for n in props):
                return False
    others = set(node) - OBJECT_KEYS
    if node_types(node) == {"object"}:
        return not others
    # other types too: the rest of node must read only those (no object keyword left behind)
    return not (others & {"propertyNames", "minProperties", "maxProperties",
                          "dependentRequired", "dependentSchemas", "dependencies",
                          "unevaluatedProperties", "allOf", "anyOf", "oneOf", "not", "if",
                          "$ref", "enum", "const"})


def _universal(pattern: str) -> bool:
    """Whether every name matches pattern: it matches the empty string at the start and looks
    at nothing after that (no end anchor, word boundary or lookaround)."""
    if pattern in UNIVERSAL:
        return True
    if any(t in pattern for t in ("$", "\\Z", "\\z", "\\b", "\\B", "(?")):
        return False
    try:
        return re.match(pattern, "") is not None
    except (re.error, RecursionError):
        return False


def _array(node: Any) -> bool:
    """Whether node is an array of item schemas (prefixItems, items) within bounds, nothing else."""
    if not (isinstance(node, dict) and "type" in node and node_types(node) == {"array"}
            and set(node) <= ARRAY_KEYS):
        return False
    prefix = node.get("prefixItems", [])
    return (isinstance(node.get("items", True), (bool, dict)) and isinstance(prefix, list)
            and all(isinstance(p, (bool, dict)) for p in prefix) and len(prefix) <= MAX_ARRAY_BOUND
            and int(node.get("minItems", 0)) <= MAX_ARRAY_BOUND
            and int(node.get("maxItems", 0)) <= MAX_ARRAY_BOUND)


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class LarkWriter:
    """One schema's grammar: ``expr`` of its root, then ``grammar(start)`` → Lark text."""

    def __init__(self, defs: dict, options: dict):
        self.defs = defs
        self.options = options
        self.rules: dict[str, str] = {}     # name → body
        self.lexemes: dict[str, str] = {}
        self.leaves: dict[str, str] = {}    # leaf JSON → rule name
        self.def_rules: dict[str, str | None] = {}
        self.merged: dict[str, str | None] = {}   # intersection's text → its rule
        self.intersection = Intersection(defs)
        self.item = _lark_string(options.get("item_separator", ","))
        self.key = _lark_string(options.get("key_separator", ":"))

    # ---- the grammar ----------------------------------------------------------------

    def grammar(self, start: str) -> str:
        """The Lark text, from the start expression (``expr`` of the root)."""
        head = []
        ws = self._whitespace()
        if ws is not None:
            head = ['%llguidance {"ignore_once": true}', f"%ignore {ws}"]
        body = [f"start: {start}"] + [f"{n}: {b}" for n, b in self.rules.items()] + \
            [f"{n}: {b}" for n, b in self.lexemes.items()]
        return "\n".join(head + body) + "\n"

    def _whitespace(self) -> str | None:
        if self.options.get("whitespace_pattern"):
            return "/(?:" + self.options["whitespace_pattern"].replace("/", "\\/") + ")/"
        if self.options.get("whitespace_flexible", True):
            return r"/[\x20\x0A\x0D\x09]+/"
        return None

    def _rule(self, body: str, stem: str) -> str:
        name = f"{stem}_{len(self.rules)}"
        self.rules[name] = body
        return name

    def expr(self, node: Any) -> str | None:
        """A Lark expression for node's instances; None when there is none."""
        if isinstance(node, dict):
            node = relevant(plain_patterns(node))
            if set(node) == {"$ref"} and isinstance(node["$ref"], str) and \
                    node["$ref"].startswith(_REF) and node["$ref"][len(_REF):] in self.defs:
                return self._def(node["$ref"][len(_REF):])
            if set(node) == {"anyOf"} and isinstance(node["anyOf"], list) and node["anyOf"]:
                return _alt([self.expr(o) for o in node["anyOf"]])
            if _object_part(node):
                rest = node_types(node) - {"object"}
                other = {k: v for k, v in node.items() if k not in OBJECT_KEYS}
                return _alt([self._object(node), self.expr({**other, "type": sorted(rest)}) if rest else None])
            if _array(node):
                return self._array(node)
            if any(k in node for k in ("allOf", "anyOf", "$ref")):
                return self._intersection(node)
            forms = number_forms(node)
            if forms:
                return _alt([self._leaf(node), self._lexeme("/(?:" + "|".join(forms) + ")/", "NUMBER")])
        return self._leaf(node)

    def _lexeme(self, body: str, stem: str) -> str:
        for name, b in self.lexemes.items():
            if b == body:
                return name
        name = f"{stem}_{len(self.lexemes)}"
        self.lexemes[name] = body
        return name

    def _intersection(self, node: dict) -> str | None:
        """allOf, or anyOf/$ref beside other keywords, merged into plain objects where every part
        is one (exact: the merged object keeps every part's constraint on every key); else a
        leaf. One rule per distinct node, so a recursive intersection is a rule that recurses."""
        text = json.dumps(node, ensure_ascii=False, sort_keys=True)
        if text in self.merged:
            return self.merged[text]
        options = self.intersection.union(node)
        if options is None:
            self.merged[text] = self._leaf(node)
            return self.merged[text]
        rule = f"all_{len(self.rules)}"
        self.merged[text] = rule            # a recursive intersection finds it
        self.rules[rule] = ""
        # a merged option's allOf holds string/number keywords only: llguidance's to intersect
        body = _alt([self._leaf(o) if "allOf" in o else self.expr(o) for o in options])
        if body is None:
            del self.rules[rule]
            self.merged[text] = None
            return None
        self.rules[rule] = body
        return rule

    def _def(self, name: str) -> str | None:
        if name not in self.def_rules:
            rule = f"def_{len(self.def_rules)}"
            self.def_rules[name] = rule     # a recursive $ref finds it
            body = self.expr(self.defs[name])
            if body is None:
                self.def_rules[name] = None
            else:
                self.rules[rule] = body
        return self.def_rules[name]

    def _leaf(self, node: Any) -> str | None:
        """node compiled by llguidance's JSON compiler, with the definitions it reaches; None
        when that compiler finds it unsatisfiable (as it drops such an option or property)."""
        if node is False:
            return None
        schema: Any = {} if node is True else dict(node)
        reached, stack = {}, list(def_refs(schema))
        while stack:
            n = stack.pop()
            if n not in reached and n in self.defs:
                reached[n] = self.defs[n]
                stack.extend(def_refs(self.defs[n]))
        schema, reached = in_schema_orders(schema, reached)
        if reached:
            schema = {**schema, "$defs": reached} if isinstance(schema, dict) else \
                {"allOf": [schema], "$defs": reached}
        schema["x-guidance"] = self.options
        text = json.dumps(schema, ensure_ascii=False)
        if text not in self.leaves:
            self.leaves[text] = None if unsatisfiable(schema) else self._rule(f"%json {text}", "json")
        return self.leaves[text]

    def _array(self, node: dict) -> str | None:
        """``[`` items ``]``: prefixItems in place, then items, within minItems..maxItems."""
        lo, hi = int(node.get("minItems", 0)), node.get("maxItems")
        hi = None if hi is None else int(hi)
        prefix = [self.expr(p) for p in node.get("prefixItems", [])]
        rest = self.expr(node.get("items", True)) if hi is None or hi > len(prefix) else None
        # the array cannot go past an item schema with no instance
        cap = next((i for i, p in enumerate(prefix) if p is None), None if rest is not None else len(prefix))
        if cap is not None and (hi is None or cap < hi):
            hi = cap
        if hi is not None and lo > hi:
            return None
        first = prefix[0] if prefix else rest
        if hi == 0 or first is None:
            return '("[" "]")' if lo == 0 else None

        def tail(i: int) -> str:
            """What follows the first i items."""
            if hi is not None and i >= hi:
                return ""
            if i >= len(prefix):
                least = max(lo - i, 0)
                if hi is None:
                    return f"({self.item} {rest})" + ("*" if least == 0 else f"{{{least},}}")
                return f"({self.item} {rest}){{{least},{hi - i}}}"
            more = f"({self.item} {prefix[i]} {tail(i + 1)})"
            return more if i < lo else more + "?"

        full = f'"[" {first} {tail(1)} "]"'
        return f'("[" "]" | {full})' if lo == 0 else f"({full})"

    def _object(self, node: dict) -> str | None:
        """The object as a parametric rule: bit i set when listed key i was written, the
        required keys first (bits 0..r-1)."""
        required = list(dict.fromkeys(node.get("required", [])))
        patterns = node.get("patternProperties", {})
        props = node.get("properties", {})
        ap = node.get("additionalProperties", True)
        if patterns and _universal(next(iter(patterns))):
            # every key matches: listed ones take both schemas, and no key is additional
            ap = next(iter(patterns.values()))
            props = {n: all_of([v, ap]) for n, v in props.items()}
            patterns = {}
        values = {n: self.expr(props[n]) for n in required + [n for n in props if n not in required]}
        if any(values[n] is None for n in required):
            return None
        member = {n: self._rule(f"{_lark_string(_lark_key(n))} {self.key} {v}", "member")
                  for n, v in values.items() if v is not None}
        if len(member) > MAX_KEYS:   # more keys than parameter bits: the schema's order
            order = [n for n in props if n in member]
            return self._in_order([member[n] for n in order], [n in required for n in order],
                                  self._extra(props, ap, patterns))
        members = list(member.values())     # the required ones first: bits 0..r-1
        extra = self._extra(props, ap, patterns)
        rest = f"rest_{len(self.rules)}"
        alts = [f'"" %if is_ones([0:{len(required)}])' if required else '""']
        alts += [f"{self.item} {m} {rest}::set_bit({i}) %if bit_clear({i})" for i, m in enumerate(members)]
        if extra:
            alts.append(f"{self.item} {extra} {rest}::_")
        self.rules[f"{rest}::_ "] = "\n    | ".join(alts)
        first = ['"{" "}"'] if not required else []
        first += [f'"{{" {m} {rest}::{hex(1 << i)} "}}"' for i, m in enumerate(members)]
        if extra and not required:   # where keys are required, one of the listed keys first
            first.append(f'"{{" {extra} {rest}::0x0 "}}"')
        return self._rule(" | ".join(first), "object")

    def _extra(self, props: dict, ap: Any, patterns: dict) -> str | None:
        """A key-value pair for a key the object does not list, or None where there is none."""
        value = self.expr(ap) if ap is not False else None
        if value is not None:
            listed = [_lark_string(_lark_key(n)) for n in props]
            key = self._lexeme(_KEY_STRING + (" & ~(" + " | ".join(listed) + ")" if listed else ""), "XKEY")
            return self._rule(f"{key} {self.key} {value}", "extra")
        if patterns and (value := self.expr(next(iter(patterns.values())))) is not None:
            # a key matching the patterns (no listed name does): a JSON string the compiler checks
            key = self._leaf({"type": "string", "pattern": "|".join(f"(?:{p})" for p in patterns)})
            return self._rule(f"{key} {self.key} {value}", "extra") if key else None
        return None

    def _in_order(self, members: list[str], required: list[bool], extra: str | None) -> str:
        """An object with its listed keys in the schema's order (each optional one may be
        left out), then any additional keys."""
        n = len(members)
        tail = f"({self.item} {extra})*" if extra else '""'
        head = f'("" | {extra} ({self.item} {extra})*)' if extra else '""'
        # from the last member back: what may follow once members[:i] are settled
        for i in range(n - 1, -1, -1):
            after = self._rule(tail, "after")        # some member already written
            start = self._rule(head, "start")        # none written yet
            with_i = f"{members[i]} {after}"
            tail = f"({self.item} {with_i})" if required[i] else f"({self.item} {with_i} | {after})"
            head = f"({with_i})" if required[i] else f"({with_i} | {start})"
        return self._rule(f'"{{" {head} "}}"', "object")


def _alt(options: list[str | None]) -> str | None:
    kept = list(dict.fromkeys(o for o in options if o is not None))
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else "(" + " | ".join(kept) + ")"


def _lark_key(name: str) -> str:
    """A property name as a JSON key (its one spelling)."""
    return json.dumps(name, ensure_ascii=False)


def _with_metadata(root: dict) -> dict:
    """A root object that takes additional keys, with the keys a document often starts with
    ("$schema", "$id", ...) listed as optional ones of the same schema: exact, and they may then
    come before the required keys, where other additional keys may not."""
    ap = root.get("additionalProperties", True)
    props = root.get("properties")
    if ap is False or not isinstance(props, dict) or not _object_part(root) or \
            node_types(root) != {"object"} or root.get("patternProperties"):
        return root
    names = [n for n in METADATA_KEYS if n not in props]
    return {**root, "properties": {**props, **{n: ap for n in names}}} if names else root


def _root_with_metadata(root: dict, intersection: Intersection) -> dict:
    """_with_metadata on the root object, or on each object of a root union or intersection."""
    root = relevant(root)
    if _object_part(root):
        return _with_metadata(root)
    options = root["anyOf"] if set(root) == {"anyOf"} and isinstance(root["anyOf"], list) else \
        intersection.union(root) if any(k in root for k in ("allOf", "anyOf", "$ref")) else None
    if not options or not any(isinstance(o, dict) and _object_part(o) for o in options):
        return root
    return {"anyOf": [_with_metadata(o) if isinstance(o, dict) and _object_part(o) else o for o in options]}


def writes(schema: Any, options: dict) -> str | None:
    """The writer's Lark grammar for this sanitized schema, or None where llguidance's compiler
    should take it whole. ``options``: the leaves' ``x-guidance`` (whitespace, separators).

    Why: llguidance's compiler is exact and compact for what it handles, but writes listed
    properties only in the schema's order, and refuses a schema past its size limit or a
    recursive $ref beside other keywords. The writer lifts all three where the structure above
    the leaves is objects, $refs, anyOf, intersections of objects and arrays. Where the root
    itself is a leaf (a string, an enum, an intersection the writer cannot merge) it gains
    nothing, and the schema goes to llguidance whole, as before."""
    if not isinstance(schema, dict) or not isinstance(schema.get("$defs", {}), dict):
        return None
    writer = LarkWriter(schema.get("$defs", {}), options)
    root = _root_with_metadata({k: v for k, v in schema.items() if k != "$defs"}, writer.intersection)
    start = writer.expr(root)
    if start is None:
        raise ValueError("the JSON schema accepts no instance")
    if start in writer.leaves.values() and len(writer.rules) == 1:
        return None
    return writer.grammar(start)
