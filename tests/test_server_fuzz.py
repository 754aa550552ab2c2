"""Hypothesis over request bodies: whatever a client sends, the server
answers in OpenAI's shape with a status below 500, and stays up.

The number of cases is the hypothesis profile's (conftest.py: a fixed,
derandomised count in make test, GUIDED_HYPOTHESIS=thorough for more);
test_every_field_was_tried checks that the cases tried every field of every
endpoint."""
from __future__ import annotations

import json
from collections import defaultdict

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from helpers.live_server import API_KEY, get, post

#: endpoint → the body fields and constraint kinds the fuzz sent
SEEN: dict[str, set[str]] = defaultdict(set)

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 100000), st.floats(allow_nan=False),
                     st.text(max_size=12))
_json = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8)
_schema = st.one_of(_json, st.sampled_from([
    {"type": "object"}, {"type": "string", "maxLength": 3}, {"enum": [1, "a"]},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 2}, {"not": {}}, True, False]))
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool",
                                                           "nobody"]),
                                  "content": st.one_of(st.text(max_size=30), st.none(), _json)})
_common = {
    "model": st.one_of(st.none(), st.just("served"), st.text(max_size=5)),
    "max_tokens": st.one_of(st.integers(-1, 4), st.just(10**6), _scalars),
    "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), _scalars),
    "top_p": st.floats(-0.5, 1.5, allow_nan=False), "top_k": st.integers(-2, 50),
    "n": st.integers(-1, 20), "seed": st.one_of(st.integers(-1, 2**64), _scalars),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), _scalars),
    "stream": st.booleans(), "logit_bias": st.one_of(_json, st.dictionaries(
        st.integers(-5, 60000).map(str), st.floats(-200, 200, allow_nan=False), max_size=2)),
    "presence_penalty": st.floats(-3, 3, allow_nan=False),
    "structured_outputs": st.one_of(st.fixed_dictionaries({"json": _schema}),
                                    st.fixed_dictionaries({"regex": st.text(max_size=8)}),
                                    st.fixed_dictionaries({"choice": _json}),
                                    st.fixed_dictionaries({"grammar": st.text(max_size=20)}), _json),
}
_CHAT_ONLY = {
    "tools": st.one_of(_json, st.lists(st.fixed_dictionaries({
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": st.text(max_size=6), "parameters": _schema})}),
        max_size=2)),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), _json),
    "response_format": st.one_of(_json, st.fixed_dictionaries({
        "type": st.just("json_schema"),
        "json_schema": st.fixed_dictionaries({"name": st.just("x"), "schema": _schema})})),
    "logprobs": _scalars, "top_logprobs": st.integers(-1, 25), "reasoning_effort": _scalars,
}
_chat = st.fixed_dictionaries({"messages": st.one_of(st.lists(_message, max_size=3), _json)},
                              optional={**_common, **_CHAT_ONLY})
_completion = st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=20), st.lists(
    st.integers(-3, 60000), max_size=5), st.lists(st.text(max_size=5), max_size=3), _json)},
    optional={**_common, "echo": st.booleans(), "logprobs": st.one_of(st.integers(-1, 25), _scalars)})
_grammar = st.fixed_dictionaries({"grammar": st.one_of(_json, st.fixed_dictionaries({
    "type": st.sampled_from(["lark", "regex", "json_schema", "choice", "other"]),
    "content": st.one_of(st.text(max_size=12), _schema)}))},
    optional={"prompt": st.text(max_size=10), "messages": st.lists(_message, max_size=2),
              "max_tokens": st.integers(0, 4)})


def _shape(body: dict) -> set[str]:
    """The fields a body holds, and which constraint it asks for."""
    out = set(body)
    for key in ("structured_outputs", "grammar"):
        if isinstance(body.get(key), dict):
            out |= {f"{key}.{k}" for k in body[key]}
    return out


def _answer(server: str, path: str, body: dict) -> None:
    SEEN[path] |= _shape(body)
    # Keep each case short: the point is the parsing, not the text (a chat
    # request without max_tokens may run to the end of the context).
    if "max_tokens" not in body or (isinstance(body["max_tokens"], int) and body["max_tokens"] > 4):
        body["max_tokens"] = 4
    status, _, text = post(server + path, json.dumps(body).encode(), API_KEY)
    assert status < 500, (path, body, status, text)
    if status != 200:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str) and error["message"], text
    elif not body.get("stream"):
        assert "choices" in json.loads(text), text


#: one well-formed case of each constraint kind, whatever the draws
KINDS = [{"json": {"type": "object"}}, {"regex": "a+"}, {"choice": ["a", "b"]},
         {"grammar": 'start: "a"'}]


def _each_kind(field: str, value):
    def add(test):
        for so in KINDS:
            test = example(body={field: value, "structured_outputs": so})(test)
        return test
    return add


@_each_kind("messages", [{"role": "user", "content": "hi"}])
@given(body=_chat)
def test_chat_bodies(server, body):
    _answer(server, "/v1/chat/completions", body)


@_each_kind("prompt", "hi")
@given(body=_completion)
def test_completion_bodies(server, body):
    _answer(server, "/v1/completions", body)


@settings(max_examples=max(25, settings().max_examples // 4))
@given(body=_grammar)
def test_grammar_bodies(server, body):
    _answer(server, "/v1/grammar", body)


def test_every_field_was_tried():
    """Every field of every endpoint, and every kind of constraint, was in
    some case (whatever the profile's count)."""
    constraints = {f"structured_outputs.{k}" for k in ("json", "regex", "choice", "grammar")}
    want = {
        "/v1/chat/completions": {"messages", *_common, *_CHAT_ONLY, *constraints},
        "/v1/completions": {"prompt", *_common, "echo", "logprobs", *constraints},
        "/v1/grammar": {"grammar", "prompt", "messages", "max_tokens", "grammar.type",
                        "grammar.content"},
    }
    if not SEEN:
        pytest.skip("the fuzz tests did not run")
    missing = {path: sorted(fields - SEEN[path]) for path, fields in want.items()
               if fields - SEEN[path]}
    assert not missing, missing


def test_still_serving_after_the_fuzz(server):
    assert get(server + "/health")[0] == 200
    status, _, text = post(server + "/v1/completions", json.dumps(
        {"model": "served", "prompt": "Hello", "max_tokens": 3}).encode(), API_KEY)
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 3
