"""Structured output that is never cut mid-structure (on_length="close", the
default for every constraint): near max_tokens the output is steered to the
shortest completion the grammar accepts and ends on an end token, so JSON
that ends by the budget still parses and validates and reports "stop" with
``closed`` set ("length" with on_length="close_as_length");
on_length="cut" keeps the cut text; a schema whose shortest instance does
not fit is refused with a message."""
from __future__ import annotations

import json
import re
from itertools import islice

import pytest

from guided import SamplingParams
from guided.grammar import on_length
from helpers.prompts import chat
from helpers.structured import BENCH_DATA, bench_schemas, obj, parses, validator

jsonschema = pytest.importorskip("jsonschema")

BENCH_SAMPLE = 19
#: Output tokens allowed beyond the schema's shortest instance: tight enough
#: that most outputs reach the budget.
SLACK = 8

PROMPT = chat("Describe a person in detail as JSON.")


# Shapes where a cut lands mid-structure: long free strings, nesting, arrays
# with a minimum, required keys after optional ones, patterns and formats.
OWN = {
    "long_strings": obj({"name": {"type": "string"}, "bio": {"type": "string"}}),
    "nested": obj({"user": obj({"name": {"type": "string"},
                                "address": obj({"city": {"type": "string"},
                                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})}),
    "array_min": obj({"tags": {"type": "array", "items": {"type": "string"}, "minItems": 2}}),
    "array_objects": obj({"people": {"type": "array", "items": obj({"name": {"type": "string"},
                                                                    "age": {"type": "integer"}})}}),
    "optional_then_required": obj({"note": {"type": "string"}, "id": {"type": "integer", "minimum": 10}},
                                  required=["id"]),
    "free_object": {"type": "object"},
    "enum_and_text": obj({"mood": {"enum": ["happy", "sad"]}, "why": {"type": "string", "minLength": 3}}),
    "numbers": obj({"xs": {"type": "array", "items": {"type": "number"}}, "total": {"type": "number"}}),
    "pattern": obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                    "text": {"type": "string"}}),
    "format_date": obj({"story": {"type": "string"}, "d": {"type": "string", "format": "date"}}),
    "any_of": obj({"v": {"anyOf": [{"type": "string"}, obj({"k": {"type": "string"}})]},
                   "w": {"type": "boolean"}}),
    "deep_arrays": obj({"m": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}}}),
}


def _bench_sample(tokens_of) -> dict[str, dict]:
    """Small JSONSchemaBench schemas (spread by name hash) that compile and
    whose shortest instance is short enough to keep the test quick."""
    short = ((f"bench:{name}", schema) for name, schema in bench_schemas(1500)
             if (n := tokens_of(schema)) is not None and n <= 32)
    return dict(islice(short, BENCH_SAMPLE))


def _shortest(llm, schema) -> int | None:
    """Tokens of the shortest instance found, or None if it does not compile."""
    try:
        m = llm.compile_grammar({"json": schema}).matcher()
    except ValueError:
        return None
    forced = m.forced_tokens()
    m.consume_tokens(forced)
    rest = m.shortest_completion()
    return None if rest is None else len(forced) + len(rest)


@pytest.fixture(scope="module")
def suite(llm):
    schemas = dict(OWN)
    if BENCH_DATA.is_dir():
        schemas.update(_bench_sample(lambda s: _shortest(llm, s)))
    budgets = {}
    for name, schema in schemas.items():
        n = _shortest(llm, schema)
        assert n is not None, name
        budgets[name] = n + SLACK
    return schemas, budgets


def _run(llm, schemas, budgets, temperature):
    """Closing is the default for json: no on_length given."""
    names = list(schemas)
    params = [SamplingParams(max_tokens=budgets[n], temperature=temperature, seed=i,
                             structured_outputs={"json": schemas[n]})
              for i, n in enumerate(names)]
    return dict(zip(names, llm.generate([PROMPT] * len(names), params)))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_at_the_budget_are_complete_and_valid(llm, suite, temperature):
    schemas, budgets = suite
    if BENCH_DATA.is_dir():
        assert len(schemas) >= 30
    closed = _run(llm, schemas, budgets, temperature)
    bad = []
    for name, out in closed.items():
        try:
            validator(schemas[name]).validate(json.loads(out.text))
        except Exception as exc:  # noqa: BLE001
            bad.append(f"{name}: {out.finish_reason} {out.error} {out.text[:300]!r}: {exc}"[:600])
            continue
        assert len(out.token_ids) <= budgets[name], name
        assert out.finish_reason == "stop", (name, out.finish_reason, out.error)
    assert not bad, "\n".join(bad)
    # The budget is tight: most outputs ran into it (and say so). Until the
    # closing takes over, the output is the one a cut run gives, so these
    # are the outputs that would have been cut.
    ended = [n for n, o in closed.items() if o.outputs[0].closed]
    assert len(ended) * 2 >= len(schemas), (len(ended), len(schemas))


def test_cut_is_the_text_as_it_stood(llm):
    """on_length="cut": the first max_tokens tokens of the longer output."""
    schema = OWN["long_strings"]
    long, short = llm.generate([PROMPT] * 2, [
        SamplingParams(max_tokens=28, structured_outputs={"json": schema, "on_length": "cut"}),
        SamplingParams(max_tokens=20, structured_outputs={"json": schema, "on_length": "cut"})])
    assert short.finish_reason == "length" and len(short.token_ids) == 20
    assert short.token_ids == long.token_ids[:20]
    assert not parses(short.text)
    closed = llm.generate(PROMPT, SamplingParams(max_tokens=20, structured_outputs={"json": schema}))[0]
    assert closed.finish_reason == "stop" and closed.outputs[0].closed and len(closed.token_ids) <= 20
    assert closed.token_ids[-1] in llm.engine.special.end_ids   # it ends as the model's own end would
    value = json.loads(closed.text)
    validator(schema).validate(value)
    assert {"name", "bio"} <= set(value)
    # Greedy: the same tokens until the closing took over.
    same = next(i for i, (a, b) in enumerate(zip(closed.token_ids + [-1], short.token_ids)) if a != b)
    assert same >= 8, (closed.text, short.text)


def test_a_schema_that_cannot_fit_is_refused_before_it_starts(llm):
    schema = obj({f"property_number_{i}": {"type": "string", "minLength": 5} for i in range(8)})
    with pytest.raises(ValueError, match="shortest output the grammar allows needs .* max_tokens") as err:
        llm.generate(PROMPT, SamplingParams(max_tokens=30, structured_outputs={"json": schema}))
    assert "30" in str(err.value) and not llm.engine.has_unfinished()
    ok = llm.generate(PROMPT, SamplingParams(max_tokens=30, structured_outputs={
        "json": schema, "on_length": "cut"}))[0]
    assert ok.finish_reason == "length"   # cut as before


def test_regex_and_lark_close_by_default(llm):
    outs = llm.generate([PROMPT] * 3, [
        SamplingParams(max_tokens=12, structured_outputs={
            "regex": r"\{\"words\": \[(\"[a-z ]+\", )*\"[a-z ]+\"\]\}"}),
        SamplingParams(max_tokens=12, structured_outputs={
            "grammar": 'start: "<" WORD ("," WORD)* ">"\nWORD: /[a-z ]+/'}),
        # vLLM's own offline example, at vLLM's default max_tokens
        SamplingParams(max_tokens=16, structured_outputs={"regex": r"\w+@\w+\.com\n"})])
    assert json.loads(outs[0].text)["words"]
    assert outs[1].text.startswith("<") and outs[1].text.endswith(">"), outs[1].text
    assert re.fullmatch(r"\w+@\w+\.com\n", outs[2].text), outs[2].text
    for o in outs:
        assert len(o.token_ids) <= 16 and o.finish_reason == "stop", o.text


def test_chat_response_format_closes_unless_cut(llm):
    schema = OWN["long_strings"]
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    msgs = [{"role": "user", "content": "Describe a person in detail as JSON."}]
    r = llm.chat(msgs, response_format=rf,
                 sampling_params=SamplingParams(max_tokens=20))[0].outputs[0]
    assert r.finish_reason == "stop" and r.closed
    value = json.loads(r.content)
    validator(schema).validate(value)
    assert {"name", "bio"} <= set(value)
    # a client that reads any budget end as truncation gets "length", and the same JSON
    r2 = llm.chat(msgs, response_format={**rf, "on_length": "close_as_length"},
                  sampling_params=SamplingParams(max_tokens=20))[0].outputs[0]
    assert r2.finish_reason == "length" and r2.closed
    validator(schema).validate(json.loads(r2.content))
    r = llm.chat(msgs, response_format={**rf, "on_length": "cut"},
                 sampling_params=SamplingParams(max_tokens=20))[0].outputs[0]
    assert r.finish_reason == "length" and not parses(r.content)


def test_closing_is_the_default_for_every_constraint():
    for so in ({"json": {"type": "object"}}, {"json_object": True}, {"regex": "a+"}, {"choice": ["a"]},
               {"grammar": "start: \"a\""}, {"structural_tag": {"structures": [], "triggers": []}}):
        assert on_length(so) == "close"
        for mode in ("cut", "close_as_length"):
            assert on_length({**so, "on_length": mode}) == mode


def test_bad_on_length_is_refused():
    with pytest.raises(ValueError, match="on_length"):
        SamplingParams(structured_outputs={"json": {"type": "object"}, "on_length": "truncate"})


#: Objects that leave additionalProperties open (JSON Schema's default), so
#: the model may write properties of its own, nested or long, into the budget.
OPEN = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
               "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "bio": {"type": "string"}}, "required": ["id"]},
        "note": {"type": "string"}}, "required": ["user", "note"]},
    "tags": {"type": "object", "properties": {"title": {"type": "string"}, "tags": {
        "type": "array", "items": {"type": "string"}}}, "required": ["title"]},
    "empty": {"type": "object"},
    "items": {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"k": {"type": "string"}}}}}, "required": ["items"]},
}
LONG = chat("Write a long, detailed JSON document about a city, with many fields of your own "
            "and long stories in them.")


def test_open_objects_are_never_cut(llm):
    """Undeclared properties (strings or nested objects running to the
    budget) are closed in time: from the shortest answer to 64 tokens more,
    greedy and sampled, every answer parses and validates."""
    runs = [(name, _shortest(llm, schema) + extra, t, seed)
            for name, schema in OPEN.items() for extra in (0, 16, 32, 64)
            for t, seed in ((0.0, 0), (1.0, 1), (1.0, 2))]
    outs = llm.generate([LONG] * len(runs), [
        SamplingParams(max_tokens=budget, temperature=t, seed=seed, structured_outputs={"json": OPEN[name]})
        for name, budget, t, seed in runs])
    bad = []
    for (name, budget, t, seed), out in zip(runs, outs):
        try:
            jsonschema.validate(json.loads(out.text), OPEN[name])
        except Exception as exc:  # noqa: BLE001
            bad.append(f"{name} {budget} {t} {seed}: {out.finish_reason} {out.error} {out.text!r}: {exc}")
    assert not bad, "\n".join(bad)
    # the model did write properties of its own into some of them
    assert any(set(json.loads(o.text)) - set(OPEN[n].get("properties", {})) for (n, *_), o in zip(runs, outs))
