"""Structural tags (vLLM's and XGrammar's ``structural_tag`` format): free
text in which every occurrence of a trigger starts a tagged structure,
``begin`` + JSON matching the structure's schema + ``end``.

    {"type": "structural_tag",
     "structures": [{"begin": "<function=get_weather>", "schema": {...}, "end": "</function>"}],
     "triggers": ["<function="]}

The text between structures may not contain a trigger, so a model that
starts a tag must finish it with valid JSON; a model that never writes a
trigger writes plain text. Each ``begin`` must start with a trigger.
"""
from __future__ import annotations

import json
from typing import Any

from .lark import alt, lit, opt, seq, star, text_without


def structural_tag_entry(spec: Any) -> dict:
    """One Lark grammar entry (schemas inline as ``%json``); ValueError
    naming what is malformed."""
    from .json_schema import json_schema_rule
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs['structural_tag'] is not valid JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise ValueError("structured_outputs['structural_tag'] must be an object")
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag.structures must be a non-empty list")
    if not isinstance(triggers, list) or not triggers or \
            not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structural_tag.triggers must be a non-empty list of non-empty strings")
    rules, tags = [], []
    for i, s in enumerate(structures):
        where = f"structural_tag.structures[{i}]"
        if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("begin", "end")):
            raise ValueError(f"{where} must have string 'begin' and 'end'")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise ValueError(f"{where}.begin {s['begin']!r} does not start with a trigger")
        schema = s.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{where}.schema must be a JSON Schema")
        rules.append(f"tag_{i}_json: {json_schema_rule(schema)}")
        tags.append(seq(lit(s["begin"]), f"tag_{i}_json", lit(s["end"])))
    start = seq(star(seq(opt("TEXT"), alt(*tags))), opt("TEXT"))
    lark = "\n".join([f"start: {start}", *rules, f"TEXT: {text_without(*triggers)}"])
    return {"lark_grammar": lark + "\n"}
