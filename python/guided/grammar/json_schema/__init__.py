"""JSON Schema → one llguidance grammar entry: sanitising, our grammar writer, whitespace.

``json_schema_grammar(schema, whitespace=None, separators=None)`` returns
``{"lark_grammar": ...}`` (our writer's grammar) or ``{"json_schema": ...}``
(llguidance's compiler takes the schema whole), which the grammar composer embeds
as one entry of ``{"grammars": [...]}``; ``json_schema_rule`` gives the same as the
body of a Lark rule.

The writer (writer.py)
----------------------
After sanitising, ``writer.writes`` decides (and says why) whether our writer takes
the structure: objects (listed keys in any order, each once, as a parametric rule),
``$defs`` as rules (recursion, size split), anyOf, arrays, intersections merged
key by key (intersect.py), number spellings (numbers.py); everything else is a
``%json`` leaf for llguidance's compiler, with property_order's variants. A leaf
llguidance finds unsatisfiable is dropped where the compiler would drop it
(oracle.py).

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
* ``uniqueItems: true`` is exact over items with a few literal values (every
  array of distinct values is listed) or one value; otherwise it caps the
  array at one item (subset; a note is logged).
* ``minProperties``/``maxProperties`` that llguidance cannot handle are
  rewritten when exact (enough required or listed properties) or narrowed.
* ``unevaluatedProperties: false`` becomes ``additionalProperties: false``
  (subset), ``propertyNames`` is applied to the listed properties when no
  other property may appear; ``patternProperties`` of literal names
  (``^(a|b)$``) become listed properties.
* Property order: llguidance takes listed properties in the schema's order
  only; in the leaves it compiles, an object becomes an anyOf of a few orders
  (the required properties first, in each order), exactly (property_order.py).
  Objects the writer takes need none of this.
* oneOf: options told apart by required keys, listed values (checked with a
  validator), types, or (for strings) llguidance's own emptiness check; a
  oneOf beside a "type" only counts that type; complements that would cut an
  option away are tried per JSON type before an option is left out.
* Lookaround patterns: ``^(?!literal)rest`` becomes two patterns; an anchor
  that cannot hold (``/^...$/``) means no string matches (lookaround.py).
* A keyword whose value has the wrong JSON type is a ValueError naming the
  keyword and its path (checks.py).

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

import json
import logging

from .property_order import in_schema_orders
from .sanitizer import sanitize_json_schema
from .whitespace import BOUNDED_WHITESPACE, whitespace_options
from .writer import writes


log = logging.getLogger("guided.grammar")

__all__ = ["BOUNDED_WHITESPACE", "json_schema_grammar", "json_schema_rule", "sanitize_json_schema",
           "whitespace_options"]


def json_schema_grammar(schema: dict | bool, whitespace: str | None = None,
                        separators: dict | None = None) -> dict:
    """One llguidance grammar entry for ``schema``: ``{"lark_grammar": ...}`` from our writer
    or ``{"json_schema": sanitized}`` (writer.writes says which).

    ``whitespace``: None (bounded, the default), "compact", "flexible", or a regex for one
    whitespace run. ``separators``: ``{"item_separator": ", ", "key_separator": ": "}`` for
    the style a chat template writes JSON in. Raises ValueError on a schema that is not a
    JSON object/boolean.
    """
    options = {**whitespace_options(whitespace), **(separators or {})}
    sanitized, notes = sanitize_json_schema(schema, any_order=False)
    for note in notes:
        log.info("json schema: %s", note)
    if sanitized is False:
        raise ValueError("the JSON schema accepts no instance (after rewriting: "
                         + "; ".join(notes[-3:]) + ")")
    if sanitized is True:
        sanitized = {}
    lark = writes(sanitized, options)
    if lark is not None:
        return {"lark_grammar": lark}
    defs = sanitized.pop("$defs", {})
    sanitized, defs = in_schema_orders(sanitized, defs)
    if defs:
        sanitized = {**sanitized, "$defs": defs} if isinstance(sanitized, dict) else \
            {"allOf": [sanitized], "$defs": defs}
    sanitized["x-guidance"] = options
    return {"json_schema": sanitized}


def json_schema_rule(schema: dict | bool, whitespace: str | None = None) -> str:
    """The body of a Lark rule for ``schema``: ``%json {...}`` or a nested ``%lark {...}`` (its
    own lexemes and whitespace, apart from the grammar around it)."""
    entry = json_schema_grammar(schema, whitespace)
    if "json_schema" in entry:
        return "%json " + json.dumps(entry["json_schema"], ensure_ascii=False)
    return "%lark {\n" + entry["lark_grammar"] + "}"
