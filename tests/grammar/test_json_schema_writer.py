"""guided.grammar.json_schema.writer: the grammar we write where llguidance's compiler stops.

Each construction is checked through llguidance on the default tokenizer against the
``jsonschema`` validator: every instance the grammar accepts validates, and the instances the
construction promises (every key order, a schema past the compiler's size limit, a recursive
$ref beside other keywords, integers written 2.0, exponents) are accepted.
"""
from __future__ import annotations

import itertools
import json

import pytest

from guided.grammar.json_schema import json_schema_grammar
from guided.grammar.json_schema.numbers import number_forms
from helpers.json_schema import accepts, llguidance, valid


def _text(doc) -> str:
    return json.dumps(doc, separators=(",", ":"))


def _raw_error(schema) -> str:
    """What llguidance's own compiler says of the schema (no sanitising, no writer)."""
    return llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema))


def _agree(tok, schema, texts):
    """Every text is accepted exactly when the validator accepts its JSON value."""
    for text in texts:
        assert accepts(tok, schema, text) == valid(schema, json.loads(text)), text


# ---- objects in any order -------------------------------------------------------------------

ANY_ORDER = {"type": "object", "additionalProperties": False, "required": ["id", "kind"],
             "properties": {"id": {"type": "integer"}, "kind": {"enum": ["a", "b"]},
                            "note": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}}
VALUES = {"id": 7, "kind": "a", "note": "n", "tags": ["x"]}


def test_the_writer_takes_objects_and_llguidance_takes_the_rest():
    assert "lark_grammar" in json_schema_grammar(ANY_ORDER)
    assert "json_schema" in json_schema_grammar({"type": "string", "maxLength": 3})


def test_every_order_of_every_subset_of_listed_keys(tok):
    names = list(ANY_ORDER["properties"])
    texts = []
    for k in range(len(names) + 1):
        for keys in itertools.permutations(names, k):
            texts.append(_text({n: VALUES[n] for n in keys}))
    assert len(texts) == 65
    _agree(tok, ANY_ORDER, texts)
    # all of them valid once both required keys are in, whatever their order
    assert accepts(tok, ANY_ORDER, '{"tags":[],"note":"","kind":"b","id":1}')


def test_a_key_twice_or_an_unknown_key_is_rejected(tok):
    for text in ['{"id":1,"kind":"a","id":2}', '{"kind":"a","id":1,"kind":"a"}',
                 '{"id":1,"kind":"a","other":1}', '{"id":1,"kind":"c"}', '{"id":"1","kind":"a"}']:
        assert not accepts(tok, ANY_ORDER, text), text


def test_additional_keys_anywhere_after_the_first_listed_one(tok):
    open_schema = {**ANY_ORDER, "additionalProperties": {"type": "integer"}}
    _agree(tok, open_schema, ['{"id":1,"x":2,"kind":"a"}', '{"kind":"a","id":1,"x":2,"y":3}',
                              '{"id":1,"kind":"a","x":"s"}'])
    # the one narrowing: where keys are required, the first key is a listed one
    assert not accepts(tok, open_schema, '{"x":2,"id":1,"kind":"a"}')
    # a listed name spelled another way is not an additional key
    assert not accepts(tok, open_schema, '{"id":1,"kind":"a","\\u0069d":2}')


def test_a_root_takes_metadata_keys_first(tok):
    schema = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
    _agree(tok, schema, ['{"$schema":"x","name":"n"}', '{"title":"t","$id":"i","name":"n"}'])


def test_objects_past_64_keys_keep_the_schemas_order(tok):
    props = {f"k{i}": {"type": "integer"} for i in range(70)}
    schema = {"type": "object", "properties": props, "required": ["k3", "k60"], "additionalProperties": False}
    assert accepts(tok, schema, '{"k0":1,"k3":2,"k60":3,"k69":4}')
    assert not accepts(tok, schema, '{"k60":3,"k3":2}')        # another order: not taken
    assert not accepts(tok, schema, '{"k0":1,"k60":3}')         # k3 required
    assert not accepts(tok, schema, '{"k3":1,"k3":2,"k60":3}')


def test_pattern_properties_beside_closed_objects(tok):
    schema = {"type": "object", "additionalProperties": False, "properties": {"version": {"type": "string"}},
              "patternProperties": {"^x-": {"type": "integer"}}, "required": ["version"]}
    assert "lark_grammar" in json_schema_grammar(schema)
    _agree(tok, schema, ['{"version":"1","x-a":1,"x-b":2}', '{"version":"1","x-a":"s"}',
                         '{"version":"1","y":1}'])
    assert not accepts(tok, schema, '{"version":"1","x-a":1,"version":"2"}')   # a listed key twice
    assert not accepts(tok, schema, '{"x-a":1,"version":"1"}')                 # the first key a listed one


def test_patterns_every_key_matches_or_that_repeat_additional_properties(tok):
    every = {"type": "object", "additionalProperties": False, "patternProperties": {".*": {"type": "integer"}}}
    _agree(tok, every, ['{"a":1,"b":2}', '{}', '{"a":"s"}'])
    same = {"type": "object", "additionalProperties": {"type": "integer"},
            "patternProperties": {"^[a-z]+$": {"type": "integer"}}, "properties": {"ID": {"type": "string"}}}
    assert "lark_grammar" in json_schema_grammar(same)
    _agree(tok, same, ['{"ID":"x","abc":1,"A1":2}', '{"ID":"x","abc":"s"}', '{"ID":1}'])
    # a listed key the pattern matches takes both schemas: the pattern stays
    both = {**same, "properties": {"id": {"type": "string"}}}
    _agree(tok, both, ['{"id":"x","abc":1}', '{"abc":1}', '{"id":1}'])


# ---- schemas past llguidance's size limit -----------------------------------------------------

def _large(n: int) -> dict:
    item = {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "integer", "minimum": 3}]}
    defs = {f"d{i}": {"type": "object", "properties": {f"q{j}": item for j in range(n)}} for i in range(n)}
    return {"type": "object", "properties": {f"p{i}": {"$ref": f"#/$defs/d{i}"} for i in range(n)},
            "$defs": defs}


def test_a_schema_past_the_size_limit_is_split(tok):
    schema = _large(80)
    assert "too large" in _raw_error(schema)
    grammar = json.dumps({"grammars": [json_schema_grammar(schema)]})
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    _agree(tok, schema, ['{"p0":{"q0":"abc","q79":5},"p79":{}}', '{"p1":{"q1":2}}', '{"p2":{"q5":"123456789"}}',
                         '{"p3":{},"p7":{"q2":"x","q3":4}}'])   # 80 keys: the schema's order


# ---- recursive references beside other keywords ----------------------------------------------

TREE = {"$defs": {"node": {"type": "object", "properties": {
    "v": {"type": "integer"},
    "kids": {"type": "array", "items": {"$ref": "#/$defs/node", "required": ["v"]}}}}},
    "$ref": "#/$defs/node", "required": ["kids"]}


def test_a_recursive_ref_with_sibling_keywords(tok):
    assert "circular" in _raw_error(TREE)
    _agree(tok, TREE, ['{"kids":[]}', '{"kids":[{"v":1}]}', '{"kids":[{"v":1,"kids":[{"v":2,"kids":[]}]}]}',
                       '{"kids":[{"kids":[]}]}', '{"v":1}', '{"kids":[{"v":1,"kids":[{"kids":[]}]}]}'])


def test_a_oneof_that_recurses_keeps_its_options_apart(tok):
    schema = {"$defs": {"list": {"type": "object", "additionalProperties": False, "required": ["t"],
                                 "properties": {"t": {"const": "list"},
                                                "items": {"type": "array", "items": {"$ref": "#/$defs/any"}}}},
                        "leaf": {"type": "object", "additionalProperties": False, "required": ["t"],
                                 "properties": {"t": {"const": "leaf"}, "v": {"type": "string"}}},
                        "any": {"oneOf": [{"$ref": "#/$defs/list"}, {"$ref": "#/$defs/leaf"}]}},
              "$ref": "#/$defs/any"}
    _agree(tok, schema, ['{"t":"list","items":[{"t":"leaf","v":"a"},{"t":"list","items":[]}]}',
                         '{"t":"leaf"}', '{"t":"leaf","items":[]}', '{"t":"list","v":"a"}'])


# ---- intersections ----------------------------------------------------------------------------

def test_all_of_objects_meet_key_by_key(tok):
    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"properties": {"a": {"minimum": 2}, "b": {"type": "string"}},
                         "additionalProperties": False}]}
    assert "lark_grammar" in json_schema_grammar(schema)
    _agree(tok, schema, ['{"a":2}', '{"b":"x","a":3}', '{"a":1}', '{"a":2,"c":1}', '{"b":"x"}'])


def test_one_of_told_apart_on_strings_by_the_compiler(tok):
    # disjoint on strings (a uuid never starts with $); both hold for any other type
    schema = {"type": "object", "properties": {"key": {"oneOf": [{"format": "uuid"},
                                                                  {"pattern": "^\\$[A-Z]+"}]}}}
    _agree(tok, schema, ['{"key":"123e4567-e89b-12d3-a456-426614174000"}', '{"key":"$ABC"}', '{"key":1}',
                         '{"key":"abc"}'])


# ---- number forms -----------------------------------------------------------------------------

@pytest.mark.parametrize("schema,texts", [
    ({"type": "number", "minimum": 0}, ["1e-06", "2.5E+3", "0e0", "0", "-1e-3", "-2"]),
    ({"type": "number", "exclusiveMaximum": 0}, ["-1e3", "-0.5", "0e1", "1e1"]),
    ({"type": "number", "minimum": -4}, ["1e3", "-3", "-5", "-1e0"]),
    ({"enum": [2.0, "a"]}, ["2", "2.0", "3.0", '"a"']),
])
def test_number_forms_as_json_schema_counts_them(tok, schema, texts):
    wrapped = {"type": "object", "properties": {"n": schema}, "required": ["n"]}
    for text in texts:
        doc = '{"n":' + text + "}"
        if text == "-1e0":      # a bound inside the negatives: that sign keeps plain digits
            assert valid(wrapped, json.loads(doc)) and not accepts(tok, wrapped, doc)
            continue
        assert accepts(tok, wrapped, doc) == valid(wrapped, json.loads(doc)), text


def test_integers_stay_digits(tok):
    # 2.0 is an integer to JSON Schema, but typed clients parse integers strictly, and a small
    # model given the choice writes 21.0000000000000000 (numbers.py)
    wrapped = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert accepts(tok, wrapped, '{"n":21}') and not accepts(tok, wrapped, '{"n":21.0}')


def test_number_forms_are_only_added_where_the_bounds_keep_a_sign_whole():
    assert number_forms({"type": "number", "minimum": 5}) == []            # cuts inside the positives
    assert number_forms({"type": "integer", "minimum": 0}) == []
    assert number_forms({"type": "number"}) == []                          # llguidance has exponents
    assert number_forms({"type": "string"}) == []


# ---- whitespace and separators -----------------------------------------------------------------

def test_the_whitespace_policy_holds_in_the_writers_grammar(tok):
    doc = {"kind": "a", "id": 1, "tags": ["x", "y"]}
    assert accepts(tok, ANY_ORDER, json.dumps(doc, indent=2))
    assert accepts(tok, ANY_ORDER, json.dumps(doc, indent=4))
    assert not accepts(tok, ANY_ORDER, '{"kind":"a",\n\n"id":1}')                 # a blank line
    assert not accepts(tok, ANY_ORDER, '{"kind":"a",' + " " * 12 + '"id":1}')     # a long run
    assert accepts(tok, ANY_ORDER, '{"id":1,"kind":"a"}', whitespace="compact")
    assert not accepts(tok, ANY_ORDER, '{"id": 1,"kind":"a"}', whitespace="compact")


def test_template_separators_in_tool_arguments(tok):
    from guided.chat.grammar import tool_args_entry
    entry = tool_args_entry(ANY_ORDER)
    hf, lt = tok
    for text, ok in [('{"kind": "a", "id": 1}', True), ('{"id": 1, "kind": "a"}', True),
                     ('{"id":1,"kind":"a"}', False)]:
        m = llguidance.LLMatcher(lt, json.dumps({"grammars": [entry]}), log_level=0)
        ids = hf.encode(text, add_special_tokens=False).ids
        assert (all(m.consume_token(t) for t in ids) and m.is_accepting()) == ok, text
