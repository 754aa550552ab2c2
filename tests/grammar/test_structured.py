"""Structured outputs end to end on the default model: JSON Schema, regex,
choice and Lark grammars, batching, failures, fast-forward, whitespace and
seeded sampling under a grammar."""
from __future__ import annotations

import json
import re
from dataclasses import replace
from itertools import islice

import pytest

from guided import SamplingParams
from helpers.prompts import chat
from helpers.structured import BENCH_DATA, bench_schemas, obj, validator

BENCH_SAMPLE = 26
# Bench schemas whose generated output breaks the schema (bugs to fix, kept
# out of the suite and checked in test_known_invalidations).
# Instances the schema rejects that a grammar once let through (regressions).
REJECTED = {
    # items.oneOf of two untyped object schemas: a non-object (a string)
    # satisfies both branches, so oneOf rejects it.
    "Github_trivial---o58627": ["https://x.example"],
}


PROMPT = chat("Reply with a short JSON example.")

OBJ = {"type": "object"}


# Our own schemas: one or two features each.
OWN_SCHEMAS: dict[str, dict] = {
    "nested": obj({"user": obj({"name": {"type": "string", "maxLength": 12},
                                "address": obj({"city": {"type": "string", "maxLength": 12},
                                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})}),
    "array_min_max": obj({"xs": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}}),
    "array_of_objects": obj({"items": {"type": "array", "maxItems": 3, "items": obj({"id": {"type": "integer"}})}}),
    "enum": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "enum_mixed": obj({"v": {"enum": [1, "two", None, True]}}),
    "const": obj({"kind": {"const": "point"}, "x": {"type": "number"}}),
    "any_of": obj({"v": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]}}),
    "one_of": obj({"shape": {"oneOf": [
        obj({"type": {"const": "circle"}, "r": {"type": "number", "minimum": 0}}, additionalProperties=False),
        obj({"type": {"const": "square"}, "side": {"type": "integer", "minimum": 1}}, additionalProperties=False)]}}),
    "ref_defs": {"$defs": {"pt": obj({"x": {"type": "integer"}, "y": {"type": "integer"}})},
                 **obj({"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}})},
    "pattern": obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
    "format_date": obj({"d": {"type": "string", "format": "date"}}),
    "format_email": obj({"e": {"type": "string", "format": "email"}}),
    "format_uuid": obj({"u": {"type": "string", "format": "uuid"}}),
    "format_datetime": obj({"t": {"type": "string", "format": "date-time"}}),
    "int_bounds": obj({"age": {"type": "integer", "minimum": 18, "maximum": 99}}),
    "number_bounds": obj({"p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}}),
    "string_length": obj({"s": {"type": "string", "minLength": 3, "maxLength": 6}}),
    "no_additional": obj({"a": {"type": "boolean"}, "b": {"type": "null"}}, additionalProperties=False),
    "optional_fields": obj({"id": {"type": "integer"}, "note": {"type": "string", "maxLength": 10},
                            "flag": {"type": "boolean"}}, required=["id"], additionalProperties=False),
    "all_optional": obj({"a": {"type": "integer"}, "b": {"type": "integer"}}, required=[],
                        additionalProperties=False),
    "top_array": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
    "top_enum": {"enum": ["yes", "no", "maybe"]},
    "top_integer": {"type": "integer", "minimum": -5, "maximum": 5},
    "type_union": obj({"v": {"type": ["integer", "null"]}}),
    "tuple_prefix": obj({"t": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 5}],
                               "items": False}}),
    "unique_bools": obj({"f": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}),
    "long_fixed_keys": obj({"the_customer_identification_number": {"type": "integer", "minimum": 0,
                                                                   "maximum": 999999},
                            "the_customer_full_legal_name": {"type": "string", "maxLength": 10}},
                           additionalProperties=False),
}


WHITESPACE_SCHEMA = obj({"a": {"type": "boolean"}, "b": {"enum": [1, 2]}}, additionalProperties=False)

RECURSIVE = {"$defs": {"node": obj({"v": {"type": "integer"},
                                    "next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}]}})},
             "$ref": "#/$defs/node"}

_COMBINATORS = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = (*_COMBINATORS, "items", "prefixItems", "additionalItems", "additionalProperties",
               "contains", "propertyNames")


def tighten(schema, in_combinator: bool = False):
    """A stricter copy of ``schema`` that a small model finishes within the
    token budget: objects closed (additionalProperties false, where that
    keeps every required key possible and no combinator shares the object),
    free strings capped at 24 characters (64 with a format or pattern), arrays at 2 items, numbers within
    ±10**6. Every instance
    of it is an instance of ``schema``, which the outputs are validated
    against."""
    if isinstance(schema, list):
        return [tighten(s, in_combinator) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):  # name → schema, not a schema
            out[k] = {name: tighten(sub) for name, sub in v.items()}
        elif k in _SUBSCHEMAS:
            out[k] = tighten(v, in_combinator or k in _COMBINATORS)
        else:
            out[k] = v
    props = schema.get("properties")
    if (isinstance(props, dict) and not in_combinator
            and not any(k in schema for k in ("additionalProperties", "patternProperties",
                                              "unevaluatedProperties", *_COMBINATORS))
            and set(schema.get("required", [])) <= set(props)):
        out["additionalProperties"] = False
    types = schema.get("type")
    types = set(types) if isinstance(types, list) else {types} if isinstance(types, str) else set()
    if "string" in types and not any(k in schema for k in ("maxLength", "enum", "const")):
        # Formats and patterns get room for their longest usual forms (a date-time, a UUID).
        cap = 64 if "format" in schema or "pattern" in schema else 24
        out["maxLength"] = max(cap, schema.get("minLength", 0))
    if "array" in types and "maxItems" not in schema:
        out["maxItems"] = max(2, schema.get("minItems", 0))
    if types & {"integer", "number"}:
        if not any(k in schema for k in ("maximum", "exclusiveMaximum")):
            out["maximum"] = 10**6
        if not any(k in schema for k in ("minimum", "exclusiveMinimum")):
            out["minimum"] = -10**6
    return out


def _bench_sample() -> dict[str, dict]:
    """A fixed, small-schema sample of JSONSchemaBench (spread by name hash)."""
    kept = ((name, schema) for name, schema in bench_schemas(1200) if name not in REJECTED)
    return dict(islice(kept, BENCH_SAMPLE))


def _suite_params(schemas: dict[str, dict], temperature: float) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=400, temperature=temperature, seed=i,
                           structured_outputs={"json": tighten(schema)})
            for i, schema in enumerate(schemas.values())]


def _whitespace_params(llm) -> list[SamplingParams]:
    """Sampling pushed hard towards whitespace, under WHITESPACE_SCHEMA: the
    default whitespace policy at temperatures 0 and 1, then "compact"."""
    bias = {t: 30.0 for t in _whitespace_tokens(llm)}
    return [SamplingParams(max_tokens=1000, temperature=t, seed=1, logit_bias=bias,
                           structured_outputs={"json": WHITESPACE_SCHEMA, **extra})
            for t, extra in ((0.0, {}), (1.0, {}), (1.0, {"whitespace": "compact"}))]


@pytest.fixture(scope="module")
def quantized():
    """The default model as users get it on a CPU (its Q4_1 blocks, the native
    step), for the module's long runs."""
    from guided import LLM
    return LLM(max_num_seqs=64, kv_cache_tokens=32768)


@pytest.fixture(scope="module")
def long_runs(quantized) -> dict:
    """The module's long generations in one engine batch, so that their
    tails overlap: the schema suite (our schemas and a JSONSchemaBench
    sample) at temperatures 0 and 1, and the whitespace-biased runs, on the
    default model as users get it."""
    llm = quantized
    schemas = dict(OWN_SCHEMAS)
    bench = _bench_sample()
    schemas.update({f"bench:{k}": v for k, v in bench.items()})
    # the longest runs first, so that the shorter ones fill the batch beside them
    params = {"whitespace": _whitespace_params(llm), "suite 0.0": _suite_params(schemas, 0.0),
              "suite 1.0": _suite_params(schemas, 1.0)}
    flat = [p for ps in params.values() for p in ps]
    outs = iter(llm.generate([PROMPT] * len(flat), flat))
    return {"schemas": schemas, "bench": bool(bench),
            **{name: [next(outs) for _ in ps] for name, ps in params.items()}}


def _check_suite(schemas: dict[str, dict], outs) -> dict[str, str]:
    """Every output validates against its schema, except those whose schema
    did not compile; returns them, with their messages."""
    refused, bad = {}, []
    for name, out in zip(schemas, outs):
        if out.finish_reason == "error" and out.error and out.error.startswith("invalid grammar"):
            refused[name] = out.error
            continue
        try:
            value = json.loads(out.text)
            validator(schemas[name]).validate(value)
        except Exception as exc:  # noqa: BLE001
            bad.append(f"{name}: {out.finish_reason} {out.error} {out.text[:200]!r}: {exc}"[:500])
    assert not bad, "\n".join(bad)
    return refused


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_suite(long_runs, temperature):
    if not long_runs["bench"]:
        pytest.skip(f"JSONSchemaBench sample not found at {BENCH_DATA}")
    schemas = long_runs["schemas"]
    assert len(schemas) >= 50
    refused = _check_suite(schemas, long_runs[f"suite {temperature}"])
    # Our own schemas all compile; bench schemas llguidance refuses fail with a message.
    assert not [n for n in refused if not n.startswith("bench:")], refused
    for name, message in refused.items():
        print(f"refused {name}: {message[:200]}")


def test_masks_on_demand_give_the_tokens_of_masks_computed_first(long_runs, quantized):
    """On a CPU a row is drawn without its grammar mask and checked after
    (masks="on_demand", the default there): over the sampled suite and the
    whitespace-biased runs (the bias makes the grammar refuse most draws),
    every output is token for token the one of masks computed beforehand
    while the forward pass runs (masks="overlap")."""
    from guided import LLM
    with pytest.raises(ValueError, match="masks must be one of 'auto', 'overlap', 'on_demand', got 'lazy'"):
        LLM(masks="lazy")   # refused before the model loads
    overlap = LLM(max_num_seqs=64, kv_cache_tokens=32768, masks="overlap")
    params = [*_whitespace_params(quantized), *_suite_params(long_runs["schemas"], 1.0)]
    want = [*long_runs["whitespace"], *long_runs["suite 1.0"]]
    outs = overlap.generate([PROMPT] * len(params), params)
    differ = [(p.structured_outputs, a.text[:80], b.text[:80])
              for p, a, b in zip(params, outs, want) if a.token_ids != b.token_ids]
    assert not differ, differ[:3]
    stats, theirs = quantized.stats(), overlap.stats()
    assert theirs["mask_rows_on_demand"] == 0
    assert 0 < stats["mask_rows_refused"] < stats["mask_rows_on_demand"], stats
    assert stats["mask_rows"] < theirs["mask_rows"], (stats, theirs)


@pytest.fixture(scope="module")
def random_drafts():
    """The default model as ``quantized`` runs it, speculating with drafts of
    random tokens (half of them out of the context): the grammar refuses
    most, and the model writes almost none."""
    from guided import LLM
    return LLM(max_num_seqs=64, kv_cache_tokens=32768, speculative=True, drafter="random:7")


def test_drafts_the_grammar_refuses_change_nothing(long_runs, quantized, random_drafts):
    """Speculative decoding checked against random drafts over the whole
    suite, greedy and seeded: every output is the one without speculation
    (so valid wherever that one is), token for token."""
    params = [replace(p, speculative=True) for p in
              [*_whitespace_params(quantized), *_suite_params(long_runs["schemas"], 0.0),
               *_suite_params(long_runs["schemas"], 1.0)]]
    want = [*long_runs["whitespace"], *long_runs["suite 0.0"], *long_runs["suite 1.0"]]
    outs = random_drafts.generate([PROMPT] * len(params), params)
    differ = [(p.structured_outputs, a.text[:80], b.text[:80])
              for p, a, b in zip(params, outs, want) if a.token_ids != b.token_ids]
    assert not differ, differ[:3]
    stats = random_drafts.stats()
    assert stats["draft_tokens"] > 500 and stats["draft_lookups_kept"] < stats["draft_lookups"] / 2, stats


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_rejected_instances_stay_rejected(llm, name):
    path = BENCH_DATA / f"{name}.json"
    if not path.exists():
        pytest.skip(f"{path} not found")
    schema = json.loads(path.read_text())["schema"]
    instance = REJECTED[name]
    assert not validator(schema).is_valid(instance)
    grammar = llm.compile_grammar({"json": schema})
    enc = llm.tokenizer.encode(json.dumps(instance), parse_special=False)
    assert not _walk(grammar.matcher(), enc), "the grammar accepts an instance the schema rejects"


def test_regex_choice_and_lark(llm):
    cases = [
        ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        ({"regex": r"(cat|dog)s?/[a-z]{2,5}"}, lambda t: re.fullmatch(r"(cat|dog)s?/[a-z]{2,5}", t)),
        ({"choice": ["Paris", "London", 'say "hi"']}, lambda t: t in ("Paris", "London", 'say "hi"')),
        ({"grammar": 'start: "Answer: " ans\nans: %json {"x-guidance": {"whitespace_flexible": false}, '
                     '"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], '
                     '"additionalProperties": false}'},
         lambda t: t.startswith("Answer: ") and isinstance(json.loads(t[8:])["ok"], bool)),
        ({"grammar": 'start: "Name: " name "."\nname[max_tokens=3]: /[A-Za-z ]+/'},
         lambda t: re.fullmatch(r"Name: [A-Za-z ]+\.", t)),
    ]
    prompt = chat("What is the capital of France? Answer briefly.")
    for temperature in (0.0, 1.0):
        outs = llm.generate([prompt] * len(cases), [
            SamplingParams(max_tokens=40, temperature=temperature, seed=3, structured_outputs=so)
            for so, _ in cases])
        for (so, ok), out in zip(cases, outs):
            assert out.finish_reason == "stop", (so, out)
            assert ok(out.text), (so, out.text)
    # The lexeme max_tokens attribute bounds the name: at most 3 tokens between the fixed parts.
    name_case = cases[-1][0]
    out = llm.generate([prompt], SamplingParams(max_tokens=40, structured_outputs=name_case))[0]
    fixed = llm.tokenizer.encode("Name:", parse_special=False)
    assert len(out.token_ids) <= len(fixed) + 3 + 2, out.token_ids


@pytest.mark.parametrize("fast_forward", [True, False])
def test_special_tokens_by_id_in_lark(llm, fast_forward):
    end = min(llm.engine.special.end_ids)
    start = llm.loaded.tokenizer.token_to_id("<|im_start|>")
    for grammar, last in ((f'start: "ok" <[{start}]>', start), (f'start: "ok" <[{end}]>', end)):
        out = llm.generate([PROMPT], SamplingParams(
            max_tokens=10, fast_forward=fast_forward,
            structured_outputs={"grammar": grammar, "allow_special_tokens": True}))[0]
        assert out.text == "ok" and out.finish_reason == "stop", (grammar, out)
        # A grammar completed by forced tokens then takes one end token.
        i = out.token_ids.index(last)
        assert all(t in llm.engine.special.end_ids for t in out.token_ids[i + 1:]), out.token_ids


def test_special_tokens_in_client_grammars_need_permission():
    from guided.grammar import special_token_refs
    assert special_token_refs('start: "a<b>" /<x>/ <[2]> x // <[3]>\nx: <|im_end|> # <c>') == \
        ["<[2]>", "<|im_end|>"]
    from guided.grammar import compose
    with pytest.raises(ValueError, match="allow_special_tokens"):
        compose({"grammar": 'start: "ok" <[2]>'})
    assert compose({"grammar": 'start: "ok" <[2]>', "allow_special_tokens": True})


def test_mixed_batch_matches_alone(llm):
    free = [chat("Tell me a fact about cats."), chat("Count to five.")]
    schema = obj({"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 12}})
    constrained = [(chat("Give JSON."), {"json": schema}), (chat("Pick one."), {"choice": ["alpha", "beta"]})]
    p_free = SamplingParams(max_tokens=24)
    alone_free = [o.token_ids for o in llm.generate(free, p_free)]
    alone_con = [llm.generate([p], SamplingParams(max_tokens=60, structured_outputs=so))[0].token_ids
                 for p, so in constrained]
    prompts = [free[0], constrained[0][0], free[1], constrained[1][0]]
    params = [p_free, SamplingParams(max_tokens=60, structured_outputs=constrained[0][1]),
              p_free, SamplingParams(max_tokens=60, structured_outputs=constrained[1][1])]
    mixed = [o.token_ids for o in llm.generate(prompts, params)]
    assert [mixed[0], mixed[2]] == alone_free
    assert [mixed[1], mixed[3]] == alone_con


def test_invalid_grammar_fails_only_its_request(llm):
    outs = llm.generate([PROMPT] * 4, [
        SamplingParams(max_tokens=8),
        SamplingParams(max_tokens=8, structured_outputs={"grammar": "start: undefined_rule"}),
        SamplingParams(max_tokens=8, structured_outputs={"regex": "(unclosed"}),
        SamplingParams(max_tokens=30, structured_outputs={"choice": ["fine"]}),
    ])
    assert outs[0].finish_reason == "length" and outs[0].error is None
    assert outs[1].finish_reason == "error" and "undefined_rule" in outs[1].error
    assert outs[2].finish_reason == "error" and outs[2].error
    assert outs[3].finish_reason == "stop" and outs[3].text == "fine"
    assert not llm.engine.has_unfinished()


def test_unknown_structured_outputs_key_is_refused():
    with pytest.raises(ValueError, match="jsonn"):
        SamplingParams(structured_outputs={"jsonn": {}})
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})


def test_fast_forward_identical_and_counted(llm):
    schema = OWN_SCHEMAS["long_fixed_keys"]

    def run(ff: bool):
        before = llm.stats()["forced_tokens"]
        out = llm.generate([PROMPT], SamplingParams(
            max_tokens=80, structured_outputs={"json": schema, "whitespace": "compact"},
            fast_forward=ff))[0]
        return out, llm.stats()["forced_tokens"] - before

    on, forced_on = run(True)
    off, forced_off = run(False)
    assert forced_on > 0 and forced_off == 0
    assert on.token_ids == off.token_ids and on.text == off.text
    json.loads(on.text)


def _whitespace_tokens(llm) -> list[int]:
    from guided.tokenizer import token_bytes
    tb = token_bytes(llm.loaded.tokenizer)
    return [i for i, b in enumerate(tb) if b and not b.startswith(b"\xff") and not b.strip()]


def test_whitespace_bias_still_ends_in_valid_json(llm, long_runs):
    """A model pushed hard towards whitespace still closes the JSON: the
    default policy bounds whitespace per position (one run of at most 8
    spaces/tabs, or a newline and at most 32 of indentation)."""
    assert len(_whitespace_tokens(llm)) > 5
    outs = long_runs["whitespace"]
    for out in outs:
        assert out.finish_reason == "stop", out.text[:300]
        assert len(out.token_ids) < 400, len(out.token_ids)
        validator(WHITESPACE_SCHEMA).validate(json.loads(out.text))
    assert outs[0].text != outs[0].text.strip() or "\n" in outs[0].text  # the bias did act
    assert not any(c.isspace() for c in outs[2].text)  # "compact" overrides the default


def test_logit_bias_moves_free_sampling(llm):
    ws = _whitespace_tokens(llm)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=5, logit_bias={t: 100.0 for t in ws}))[0]
    assert all(t in ws for t in out.token_ids)


def _walk(matcher, ids: list[int]) -> bool:
    for t in ids:
        mask = matcher.compute_mask()
        if not (int(mask[t // 32]) >> (t % 32)) & 1 or not matcher.consume_token(t):
            return False
    return matcher.is_accepting()


def test_compact_and_indented_json_are_accepted(llm):
    schema = obj({"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
                  "inner": obj({"x": {"type": "integer"}})})
    value = {"name": "Ann", "tags": ["a", "b"], "inner": {"x": 3}}
    grammar = llm.compile_grammar({"json": schema})
    enc = lambda s: llm.tokenizer.encode(s, parse_special=False)  # noqa: E731
    for text in (json.dumps(value), json.dumps(value, separators=(",", ":")),
                 json.dumps(value, indent=2), json.dumps(value, indent=4)):
        assert _walk(grammar.matcher(), enc(text)), text
    # Whitespace per position is bounded by default, free with "flexible".
    padded = '{"name":' + " " * 40 + '"Ann", "tags": [], "inner": {"x": 3}}'
    assert not _walk(grammar.matcher(), enc(padded))
    flexible = llm.compile_grammar({"json": schema, "whitespace": "flexible"})
    assert _walk(flexible.matcher(), enc(padded))
    # A recursive $ref, nested three deep, both ways.
    chain = {"v": 1, "next": {"v": 2, "next": {"v": 3, "next": None}}}
    recursive = llm.compile_grammar({"json": RECURSIVE})
    for text in (json.dumps(chain, separators=(",", ":")), json.dumps(chain, indent=2)):
        assert _walk(recursive.matcher(), enc(text)), text


def test_seeded_sampling_is_reproducible_under_a_grammar(llm):
    schema = obj({"word": {"type": "string", "maxLength": 10}, "n": {"type": "integer"}})
    p = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured_outputs={"json": schema})
         for s in (7, 7, 8)]
    a, b, c = llm.generate([PROMPT] * 3, p)
    assert a.token_ids == b.token_ids
    again = llm.generate([PROMPT], p[0])[0]
    assert again.token_ids == a.token_ids
    assert c.token_ids != a.token_ids or c.text == a.text


def test_stats_report_masks(llm):
    llm.generate([PROMPT], SamplingParams(max_tokens=30, structured_outputs={"choice": ["one", "two"]}))
    s = llm.stats()
    for key in ("forced_tokens", "mask_time_us", "mask_wait_us", "mask_rows"):
        assert key in s
    assert s["mask_rows"] > 0 and s["mask_time_us"] > 0
