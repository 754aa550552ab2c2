"""Hypothesis over request bodies: whatever a client sends, the server
answers with a status below 500, in the shape of the API it was sent to
(OpenAI's, or Anthropic's on /v1/messages), and stays up.

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

_text_part = st.fixed_dictionaries({
    "type": st.sampled_from(["input_text", "output_text", "input_image", "text", "other"]),
    "text": st.one_of(st.text(max_size=12), _scalars)})
_item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant",
                                                    "nobody"]),
                           "content": st.one_of(st.text(max_size=20), st.lists(_text_part, max_size=2),
                                                _json)},
                          optional={"type": st.sampled_from(["message", "other"])}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.text(max_size=4),
                           "name": st.text(max_size=6), "arguments": st.one_of(st.text(max_size=8),
                                                                              _json)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.text(max_size=4),
                           "output": st.one_of(st.text(max_size=8), _json)}),
    st.fixed_dictionaries({"type": st.just("reasoning"), "summary": st.lists(_text_part, max_size=1),
                           "content": st.lists(_text_part, max_size=1)}),
    st.fixed_dictionaries({"type": st.just("item_reference"), "id": st.text(max_size=6)}),
    _json)
_RESPONSES = {
    "model": _common["model"], "instructions": st.one_of(st.text(max_size=12), _scalars),
    "tools": st.one_of(_json, st.lists(st.fixed_dictionaries({
        "type": st.sampled_from(["function", "web_search", "other"]), "name": st.text(max_size=6),
        "parameters": _schema}, optional={"strict": st.booleans()}), max_size=2)),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "other"]), _json,
                             st.fixed_dictionaries({"type": st.just("function"),
                                                    "name": st.text(max_size=6)})),
    "parallel_tool_calls": _scalars,
    "text": st.one_of(_json, st.fixed_dictionaries({"format": st.one_of(
        _json, st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "other"])}),
        st.fixed_dictionaries({"type": st.just("json_schema"), "name": st.just("x"),
                               "schema": _schema}, optional={"strict": st.booleans()}))})),
    "reasoning": st.one_of(_json, st.fixed_dictionaries({"effort": st.one_of(
        st.sampled_from(["none", "minimal", "low", "medium", "high"]), _scalars)})),
    "max_output_tokens": st.one_of(st.integers(-1, 4), _scalars),
    "temperature": _common["temperature"], "top_p": _common["top_p"], "top_k": _common["top_k"],
    "seed": _common["seed"], "stream": st.booleans(), "store": st.booleans(),
    "previous_response_id": st.one_of(st.text(max_size=8), _scalars),
    "metadata": _json, "user": _scalars, "truncation": _scalars, "background": _scalars,
    "max_tool_calls": _scalars,
}
_responses = st.fixed_dictionaries({"input": st.one_of(st.text(max_size=20),
                                                       st.lists(_item, max_size=3), _json)},
                                   optional=_RESPONSES)
_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(st.text(max_size=12), _scalars)}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.text(max_size=4),
                           "name": st.text(max_size=6), "input": _json}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.text(max_size=4)},
                          optional={"content": st.one_of(st.text(max_size=8), _json),
                                    "is_error": st.booleans()}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": st.text(max_size=8),
                           "signature": st.text(max_size=4)}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "document", "other"])}),
    _json)
_MESSAGES = {
    "system": st.one_of(st.text(max_size=12), st.lists(_block, max_size=2), _json),
    "tools": st.one_of(_json, st.lists(st.fixed_dictionaries(
        {"name": st.text(max_size=6), "input_schema": _schema},
        optional={"description": st.text(max_size=8), "type": st.sampled_from(
            ["custom", "bash_20250124", "other"])}), max_size=2)),
    "tool_choice": st.one_of(_json, st.fixed_dictionaries(
        {"type": st.sampled_from(["auto", "any", "tool", "none", "other"])},
        optional={"name": st.text(max_size=6), "disable_parallel_tool_use": _scalars})),
    "thinking": st.one_of(_json, st.fixed_dictionaries(
        {"type": st.sampled_from(["enabled", "disabled", "adaptive", "other"])},
        optional={"budget_tokens": st.one_of(st.integers(-1, 2000), _scalars)})),
    "output_config": st.one_of(_json, st.fixed_dictionaries({"format": st.one_of(
        _json, st.fixed_dictionaries({"type": st.just("json_schema"), "schema": _schema}))})),
    "stop_sequences": st.one_of(st.lists(st.text(max_size=3), max_size=2), _scalars),
    "temperature": _common["temperature"], "top_p": _common["top_p"], "top_k": _common["top_k"],
    "stream": st.booleans(), "metadata": _json,
}
# model and max_tokens are required here, mostly well-formed, so that most
# cases get past them to the rest of the body (a body without them:
# test_agent_apis.py).
_messages = st.fixed_dictionaries({
    "model": st.one_of(st.just("served"), st.just("served"), _common["model"]),
    "max_tokens": st.one_of(st.integers(1, 4), st.integers(-1, 4), _scalars),
    "messages": st.one_of(st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "assistant", "user", "assistant", "system", "nobody"]),
        "content": st.one_of(st.text(max_size=20), st.lists(_block, min_size=1, max_size=3),
                             _json)}), min_size=1, max_size=3), _json)}, optional=_MESSAGES)
#: the field that bounds a case's length, and the key a success holds
_LIMIT = {"/v1/responses": "max_output_tokens", "/v1/messages": "max_tokens"}
_SUCCESS = {"/v1/responses": "output", "/v1/messages": "content",
            "/v1/messages/count_tokens": "input_tokens"}


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
    # request without max_tokens may run to the end of the context). The
    # Messages API requires max_tokens: a case without it stays without.
    limit = _LIMIT.get(path, "max_tokens")
    too_long = isinstance(body.get(limit), int) and body[limit] > 4
    if too_long or (limit not in body and path != "/v1/messages"):
        body[limit] = 4
    status, _, text = post(server + path, json.dumps(body).encode(), API_KEY)
    assert status < 500, (path, body, status, text)
    if status != 200:
        answer = json.loads(text)
        if path.startswith("/v1/messages"):
            assert answer["type"] == "error" and answer["error"]["type"], text
        error = answer["error"]
        assert isinstance(error["message"], str) and error["message"], text
    elif not body.get("stream"):
        assert _SUCCESS.get(path, "choices") in json.loads(text), text


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


def _fuzz(strategy, *paths: str, share: int, examples=()):
    """A test sending each drawn body to ``paths``, with 1/``share`` of the
    profile's cases (at least 25) besides the well-formed ``examples``."""
    @settings(max_examples=max(25, settings().max_examples // share))
    @given(body=strategy)
    def test(server, body):
        for path in paths:
            _answer(server, path, dict(body))
    for body in examples:
        test = example(body=body)(test)
    return test


_TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}
test_grammar_bodies = _fuzz(_grammar, "/v1/grammar", share=4)
test_responses_bodies = _fuzz(_responses, "/v1/responses", share=2, examples=[
    {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": _TOOL["input_schema"]}],
     "tool_choice": "auto", "stream": True},
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
     "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}}])
test_messages_bodies = _fuzz(_messages, "/v1/messages/count_tokens", "/v1/messages", share=2,
                             examples=[
    {"model": "served", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
     "tools": [_TOOL], "tool_choice": {"type": "auto"}, "stream": True},
    {"model": "served", "max_tokens": 4, "system": [{"type": "text", "text": "be brief"}],
     "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
     "stop_sequences": ["."], "thinking": {"type": "disabled"}}])


def test_every_field_was_tried():
    """Every field of every endpoint, and every kind of constraint, was in
    some case (whatever the profile's count)."""
    constraints = {f"structured_outputs.{k}" for k in ("json", "regex", "choice", "grammar")}
    want = {
        "/v1/chat/completions": {"messages", *_common, *_CHAT_ONLY, *constraints},
        "/v1/completions": {"prompt", *_common, "echo", "logprobs", *constraints},
        "/v1/grammar": {"grammar", "prompt", "messages", "max_tokens", "grammar.type",
                        "grammar.content"},
        "/v1/responses": {"input", *_RESPONSES},
        "/v1/messages": {"model", "max_tokens", "messages", *_MESSAGES},
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
