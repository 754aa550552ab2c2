"""python -m guided.serve answering the official openai client: chat,
completions, n, logprobs, structured outputs and the errors a user can hit."""
from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest

from helpers.live_server import API_KEY, get, metric, post


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


ASK = [{"role": "user", "content": "Name the capital of France."}]


# -- 1. the basics ---------------------------------------------------------


def test_models_and_health(server, client, model):
    assert get(server + "/health")[0] == 200
    assert [m.id for m in client.models.list().data] == [model]


def test_completion(client, model):
    out = client.completions.create(model=model, prompt="The capital of France is",
                                    max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5
    assert out.choices[0].text.strip()


def test_completion_prompt_list_echo_and_n(client, model):
    prompts = ["The capital of France is", "1, 2, 3,"]
    one = [client.completions.create(model=model, prompt=p, max_tokens=6, temperature=0)
           .choices[0].text for p in prompts]
    out = client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0,
                                    n=2, echo=True)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [prompts[0] + one[0]] * 2 + [prompts[1] + one[1]] * 2
    assert out.usage.completion_tokens == 24


def test_chat_and_stream_agree(client, model):
    full = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=48)
    assert "Paris" in full.choices[0].message.content
    assert full.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(
        model=model, messages=ASK, temperature=0, max_tokens=48, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert "<|im_end|>" not in text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["stop"]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_continue_final_message_as_vllm(client, model):
    """vLLM's extra fields: the answer continues the final assistant message,
    as the completions endpoint continues the same rendered text."""
    start = [*ASK, {"role": "assistant", "content": "The capital of France is"}]
    out = client.chat.completions.create(
        model=model, messages=start, temperature=0, max_tokens=8,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    rendered = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                "Face<|im_end|>\n<|im_start|>user\nName the capital of France.<|im_end|>\n"
                "<|im_start|>assistant\nThe capital of France is")
    plain = client.completions.create(model=model, prompt=rendered, temperature=0, max_tokens=8)
    assert out.choices[0].message.content == plain.choices[0].text
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        client.chat.completions.create(model=model, messages=start, max_tokens=8,
                                       extra_body={"continue_final_message": True})


def test_n_choices_share_the_prompt_blocks(client, model):
    long_ask = [{"role": "system", "content": "You are a helpful assistant. " * 12}, *ASK]
    out = client.chat.completions.create(model=model, messages=long_ask, temperature=1.0, seed=7,
                                         n=3, max_tokens=12)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.content is not None for c in out.choices)
    assert len({c.message.content for c in out.choices}) > 1, "seeds differ per choice"
    # Asked again with the prompt now in the cache: the same seeds give the
    # same answers, whole and streamed. (Not compared with the first answer:
    # attention over cached blocks and over a fresh prefill differ in the
    # last bits, which a temperature-1 draw may turn into another token.)
    again = client.chat.completions.create(model=model, messages=long_ask, temperature=1.0, seed=7,
                                           n=3, max_tokens=12)
    assert all(c.message.content is not None for c in again.choices)
    streamed = {}
    for chunk in client.chat.completions.create(model=model, messages=long_ask, temperature=1.0,
                                                seed=7, n=3, max_tokens=12, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == [c.message.content for c in again.choices]


def test_logprobs_top1_is_the_greedy_token(client, model):
    out = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=16,
                                         logprobs=True, top_logprobs=5)
    entries = out.choices[0].logprobs.content
    assert entries and "".join(e.token for e in entries) == out.choices[0].message.content
    for e in entries:
        assert len(e.top_logprobs) == 5
        assert e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert all(a.logprob >= b.logprob for a, b in zip(e.top_logprobs, e.top_logprobs[1:]))
        assert e.logprob <= 0 and bytes(e.bytes).decode("utf-8", "replace") == e.token
    streamed = [e for chunk in client.chat.completions.create(
        model=model, messages=ASK, temperature=0, max_tokens=16, logprobs=True, top_logprobs=5,
        stream=True) if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == \
        [(e.token, round(e.logprob, 4)) for e in entries]
    cmpl = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6,
                                     temperature=0, logprobs=3)
    lp = cmpl.choices[0].logprobs
    assert "".join(lp.tokens) == cmpl.choices[0].text
    assert all(max(top, key=top.get) == tok for tok, top in zip(lp.tokens, lp.top_logprobs))
    assert lp.text_offset[0] == 0


# -- 3. structured outputs -------------------------------------------------

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}


def test_response_format_json_schema_and_json_object(client, model):
    out = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=80, temperature=1.0, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA,
                                                                "strict": True}})
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    ask_json = [{"role": "user", "content": "What is the capital of France? Answer in JSON with "
                                            "the key city."}]
    obj = client.chat.completions.create(model=model, messages=ask_json, max_tokens=60,
                                         temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "bio": {"type": "string"}},
          "required": ["name", "bio"], "additionalProperties": False}
DESCRIBE = [{"role": "user", "content": "Describe a person in detail as JSON."}]


def test_json_that_reaches_max_tokens_still_parses(server, client, model):
    """Closing is the default: at the budget the answer is closed, not cut,
    and ends "stop" with the ``closed`` marker (counted in /metrics);
    on_length "cut" returns the cut text."""
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    before = metric(server, "guided_closed_outputs_total") or 0
    closed = client.chat.completions.create(model=model, messages=DESCRIBE, max_tokens=20,
                                            temperature=0, response_format=rf).choices[0]
    assert closed.finish_reason == "stop" and closed.closed is True
    jsonschema.validate(json.loads(closed.message.content), PERSON)
    assert metric(server, "guided_closed_outputs_total") >= before + 1
    cut = client.chat.completions.create(model=model, messages=DESCRIBE, max_tokens=20, temperature=0,
                                         extra_body={"structured_outputs": {
                                             "json": PERSON, "on_length": "cut"}}).choices[0]
    assert cut.finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(cut.message.content)
    cmpl = client.completions.create(model=model, prompt="A person as JSON:", max_tokens=20,
                                     temperature=0, extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(cmpl.choices[0].text), PERSON)


@pytest.mark.parametrize("so, check", [
    ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: len(t) == 8 and t[3] == "-"),
    ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"grammar": 'start: "Paris" | "Lyon"'}, lambda t: t in ("Paris", "Lyon")),
    ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structural_tag": {"type": "structural_tag", "triggers": ["<city>"], "structures": [
        {"begin": "<city>", "schema": SCHEMA, "end": "</city>"}]}},
     lambda t: "<city>" not in t or jsonschema.validate(
         json.loads(t.split("<city>", 1)[1].split("</city>", 1)[0]), SCHEMA) is None),
])
def test_structured_outputs_with_the_flag(client, model, so, check):
    chat = client.chat.completions.create(model=model, messages=ASK, max_tokens=60, temperature=1.0,
                                          seed=1, extra_body={"structured_outputs": so})
    assert check(chat.choices[0].message.content)
    cmpl = client.completions.create(model=model, prompt="Answer:", max_tokens=60, temperature=1.0,
                                     seed=2, extra_body={"structured_outputs": so})
    assert check(cmpl.choices[0].text)


def test_grammar_endpoint(server):
    body = {"grammar": {"type": "regex", "content": "(red|green|blue)"},
            "prompt": "My favourite colour is", "max_tokens": 8}
    status, _, text = post(server + "/v1/grammar", json.dumps(body).encode(), API_KEY)
    assert status == 200 and json.loads(text)["choices"][0]["text"] in ("red", "green", "blue")
    body = {"grammar": {"type": "lark", "content": 'start: "Paris"'}, "messages": ASK}
    status, _, text = post(server + "/v1/grammar", json.dumps(body).encode(), API_KEY)
    assert status == 200
    assert json.loads(text)["choices"][0]["message"]["content"] == "Paris"


def test_constraints_need_the_flag(small_server):
    plain = openai.OpenAI(base_url=small_server + "/v1", api_key="x", max_retries=0)
    model = plain.models.list().data[0].id
    for so in ({"regex": "a+"}, {"choice": ["a"]}, {"grammar": 'start: "a"'}):
        with pytest.raises(openai.BadRequestError, match="--allow-constraint-api"):
            plain.chat.completions.create(model=model, messages=ASK, max_tokens=4,
                                          extra_body={"structured_outputs": so})
    status, _, text = post(small_server + "/v1/grammar", json.dumps(
        {"grammar": {"type": "regex", "content": "a"}, "prompt": "x"}).encode())
    assert status == 400 and "--allow-constraint-api" in json.loads(text)["error"]["message"]
    out = plain.chat.completions.create(  # JSON schemas are always on
        model=model, messages=ASK, max_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


# -- 4. errors: OpenAI's shape, and the server keeps serving --------------


def _error(status: int, text: str) -> dict:
    body = json.loads(text)
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


@pytest.mark.parametrize("kwargs, needle", [
    ({"temperature": 5}, "temperature"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "minProperties": "x"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}}}},
     "missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                         for i in range(300)}}}}}, "--max-grammar-bytes"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"messages": []}, "messages"),
    ({"n": 1000}, "less than or equal to 16"),
    ({"max_tokens": 100000}, "context length"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
     "shortest output the grammar allows needs"),
    ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: <|im_end|>"}}},
     "--allow-grammar-special-tokens"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: ("}}}, "structured_outputs"),
])
def test_bad_requests_are_400_and_server_survives(client, model, kwargs, needle):
    args = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            **kwargs}
    with pytest.raises(openai.BadRequestError, match=needle) as err:
        client.chat.completions.create(**args)
    assert err.value.body and "message" in err.value.body
    ok = client.chat.completions.create(model=model, max_tokens=2, temperature=0,
                                        messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].message.content is not None


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-17", messages=ASK, max_tokens=2)


def test_malformed_bodies_are_400_in_one_shape(server):
    for body in (b"{not json", b"[1, 2]", b'{"messages": "hi"}', b""):
        status, _, text = post(server + "/v1/chat/completions", body, API_KEY)
        assert status == 400, (body, status, text)
        _error(status, text)
    status, _, text = post(server + "/v1/nowhere", b"{}", API_KEY)
    assert status == 404 and _error(status, text)
    assert get(server + "/health")[0] == 200


def test_grammar_endpoint_names_a_bad_inner_field(server):
    body = {"grammar": {"type": "lark", "content": 'start: "a"'}, "messages": []}
    status, _, text = post(server + "/v1/grammar", json.dumps(body).encode(), API_KEY)
    assert status == 400 and _error(status, text)["param"] == "messages", text


def test_prompt_too_long_is_400(client, model):
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=model, prompt=[1] * 10000, max_tokens=4)


def test_api_key_required(server):
    status, text = get(server + "/v1/models")
    assert status == 401 and _error(status, text)["type"] == "authentication_error"
    assert get(server + "/v1/models", API_KEY)[0] == 200


def test_a_client_that_gives_up_on_a_whole_answer_frees_its_blocks(server, model):
    impatient = openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=1.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=model, prompt="Tell me a long story.", max_tokens=2000,
                                     temperature=0, extra_body={"ignore_eos": True})
    deadline = time.time() + 10
    while time.time() < deadline and metric(server, "guided_num_running") != 0.0:
        time.sleep(0.2)
    assert metric(server, "guided_num_running") == 0.0


def test_disconnect_frees_blocks_and_metrics(server, client, model):
    stream = client.completions.create(model=model, prompt="Tell me a long story.",
                                       max_tokens=500, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.time() + 30
    while time.time() < deadline and metric(server, "guided_num_running") != 0.0:
        time.sleep(0.2)
    assert metric(server, "guided_num_running") == 0.0
    assert metric(server, "guided_kv_cache_usage_ratio") == 0.0
    text = get(server + "/metrics")[1]
    for name in ("guided_generated_tokens_total", "guided_prefix_cache_hit_ratio",
                 "guided_inter_token_latency_seconds_bucket", "guided_grammar_compile_seconds_count",
                 "guided_mask_time_seconds_total", "guided_forced_tokens_total",
                 'guided_requests_total{endpoint="completions"',
                 'status="499"'):
        assert name in text, name


OPEN_A = {"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1}


def test_strict_closes_objects_to_unlisted_properties(client, model):
    """strict: true is OpenAI's strict mode: no property beyond those listed;
    without it JSON Schema's default lets the model add its own (this one
    does, greedily)."""
    keys = {}
    for strict in (False, True):
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Give me a JSON object."}],
            max_tokens=40, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": OPEN_A,
                                                                    "strict": strict}})
        value = json.loads(out.choices[0].message.content)
        jsonschema.validate(value, OPEN_A)
        keys[strict] = set(value)
    assert keys[True] == {"a"}
    assert keys[False] - {"a"}, keys


def test_cached_tokens_never_exceed_the_prompt(client, model):
    """An answer whose first tokens the grammar forces, asked twice: the
    second finds prompt and forced tokens in the cache, but only prompt
    tokens count as cached."""
    schema = {"type": "object", "properties": {"a_rather_long_property_name_to_force": {
        "type": "string"}}, "required": ["a_rather_long_property_name_to_force"],
        "additionalProperties": False}
    for _ in range(2):
        out = client.chat.completions.create(
            model=model, messages=ASK, max_tokens=30, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": schema}})
        usage = out.usage
        assert usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens, usage
    assert usage.prompt_tokens_details.cached_tokens > 0, usage


def test_a_request_may_speculate_and_the_metrics_show_it(server, client, model):
    """"speculative": true in a body turns speculative decoding on for that
    request: the same answer as without, and /metrics counts its drafts."""
    order = ("Order 20871-C was placed by Ingrid Nakamura (ingrid.nakamura@example.org) for 2 units "
             "of the Quantum Desk Lamp, shipped to 88 Harbour View Road, Wellington.")
    schema = {"type": "object", "properties": {"customer": {"type": "string"}, "email": {"type": "string"},
              "address": {"type": "string"}}, "required": ["customer", "email", "address"]}
    ask = dict(model=model, max_tokens=80, temperature=0,
               messages=[{"role": "user", "content": f"Extract the order as JSON.\n\n{order}"}],
               response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": schema}})
    before = metric(server, "guided_draft_steps_total") or 0.0
    plain = client.chat.completions.create(**ask)
    drafted = client.chat.completions.create(**ask, extra_body={"speculative": True})
    assert drafted.choices[0].message.content == plain.choices[0].message.content
    assert metric(server, "guided_draft_steps_total") > before
    assert metric(server, "guided_draft_acceptance_ratio") > 0
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**ask, extra_body={"speculative": "sometimes"})
