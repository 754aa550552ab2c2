"""A call carries the parameters its function declares. Tool schemas as
people write them rarely say additionalProperties, and JSON Schema then
allows any key: a small model fills calls with keys of its own
("description", copies of the schema), and a Python function given an
unexpected keyword raises TypeError. Unless the tool says ``"strict":
false`` (JSON Schema's open default) or its schema allows more, the
grammar writes only declared keys, at every depth."""
from __future__ import annotations

import inspect
import json

import jsonschema

from guided import ChatOptions, SamplingParams

#: as BFCL and OpenAI's examples write them: no additionalProperties anywhere
BOOK = {"type": "function", "function": {
    "name": "book_hotel", "description": "Book a hotel room",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city"},
        "nights": {"type": "integer", "description": "how many nights"},
        "guest": {"type": "object", "properties": {"name": {"type": "string"}},
                  "required": ["name"]}},
        "required": ["city", "guest"]}}}
#: a schema that allows more keeps it
NOTE = {"type": "function", "function": {
    "name": "save_note", "description": "Save a note with any fields",
    "parameters": {"type": "object", "properties": {"title": {"type": "string"}},
                   "required": ["title"], "additionalProperties": {"type": "string"}}}}
ASK = [{"role": "user", "content": "Book a hotel in Rome for Ada. Fill in every field you can "
                                   "think of: description, required_fields, notes, schema, type."}]


def book_hotel(city: str, guest: dict, nights: int = 1) -> str:
    """What the agent would call: it takes the declared keywords only."""
    return f"{guest['name']} in {city} for {nights}"


def _keys(value, schema) -> set[str]:
    """Keys written at any depth that ``schema`` does not declare."""
    if not isinstance(value, dict):
        return set()
    props = schema.get("properties", {})
    extra = set(value) - set(props)
    return extra | {k for name, v in value.items() if name in props for k in _keys(v, props[name])}


def test_calls_carry_only_declared_parameters(llm):
    params = [SamplingParams(max_tokens=160, temperature=1.0, seed=s) for s in range(12)]
    outs = llm.chat([ASK] * len(params), params, tools=[BOOK], tool_choice="required",
                    use_tqdm=False)
    schema = BOOK["function"]["parameters"]
    calls = [c for o in outs for c in o.outputs[0].tool_calls or []]
    assert len(calls) >= len(params), [o.outputs[0].text for o in outs]
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, schema)
        assert not _keys(args, schema), args
        inspect.signature(book_hotel).bind(**args)   # no TypeError


def test_strict_false_and_open_schemas_keep_json_schemas_default(llm):
    def schemas(*tools) -> dict:
        plan = llm.prepare_chat(ASK, SamplingParams(max_tokens=128),
                                ChatOptions(tools=list(tools), tool_choice="required"))
        return plan.parser().schemas
    closed = schemas(BOOK, NOTE)
    assert closed["book_hotel"]["additionalProperties"] is False
    assert closed["book_hotel"]["properties"]["guest"]["additionalProperties"] is False
    assert closed["save_note"]["additionalProperties"] == {"type": "string"}
    opened = schemas({"type": "function", "function": {**BOOK["function"], "strict": False}})
    assert opened["book_hotel"] == BOOK["function"]["parameters"]
