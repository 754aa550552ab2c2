"""python -m guided.serve answering the official openai client."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

API_KEY = "test-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, key: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "guided.serve", "--port", str(port), "--api-key", API_KEY,
         "--kv-cache-tokens", "16384", "--log-level", "warning"])
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}")
        try:
            if _get(base + "/health")[0] == 200:
                break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("server did not come up in 120 s")
    yield base
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0)


def _model(client) -> str:
    return client.models.list().data[0].id


def test_completion(client):
    out = client.completions.create(model=_model(client), prompt="The capital of France is",
                                    max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5
    assert out.choices[0].text.strip()


def test_chat_and_stream_agree(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=_model(client), messages=messages,
                                          temperature=0, max_tokens=48)
    assert "Paris" in full.choices[0].message.content
    assert full.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(
        model=_model(client), messages=messages, temperature=0, max_tokens=48, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert "<|im_end|>" not in text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["stop"]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_stop_string_in_stream(client):
    chunks = client.completions.create(model=_model(client), prompt="1, 2, 3, 4, 5,",
                                       max_tokens=20, temperature=0, stop=[" 8"], stream=True)
    text = "".join(c.choices[0].text for c in chunks)
    assert " 8" not in text and text.startswith(" 6")


@pytest.mark.parametrize("kwargs, needle", [
    ({"temperature": 5}, "temperature"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "minProperties": "x"}}}}, "response_format"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"messages": []}, "messages"),
])
def test_bad_requests_are_400_and_server_survives(client, kwargs, needle):
    args = {"model": _model(client), "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}], **kwargs}
    with pytest.raises(openai.BadRequestError, match=needle):
        client.chat.completions.create(**args)
    ok = client.chat.completions.create(model=_model(client), max_tokens=2,
                                        messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].message.content is not None


def test_prompt_too_long_is_400(client):
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=_model(client), prompt=[1] * 10000, max_tokens=4)


def test_disconnect_frees_blocks_and_metrics(server, client):
    stream = client.completions.create(model=_model(client), prompt="Tell me a long story.",
                                       max_tokens=500, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        status, text = _get(server + "/metrics")
        if "guided_num_running 0.0" in text:
            break
        time.sleep(0.2)
    assert status == 200 and "guided_num_running 0.0" in text
    assert "guided_generated_tokens_total" in text


def test_api_key_required(server):
    assert _get(server + "/v1/models")[0] == 401
    assert _get(server + "/v1/models", API_KEY)[0] == 200


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_calls_whole_and_streamed(client):
    import json

    import jsonschema
    full = client.chat.completions.create(model=_model(client), messages=ASK, tools=[WEATHER],
                                          tool_choice="required", max_tokens=64, temperature=0,
                                          parallel_tool_calls=False)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    name, args, reasons = None, "", []
    for chunk in client.chat.completions.create(model=_model(client), messages=ASK, tools=[WEATHER],
                                                tool_choice="required", max_tokens=64, temperature=0,
                                                parallel_tool_calls=False, stream=True):
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            name = d.function.name or name
            args += d.function.arguments or ""
        if chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
    assert (name, args, reasons) == ("get_weather", call.function.arguments, ["tool_calls"])
    # the call and its result, sent back: the next prompt hits the prefix cache
    turn2 = ASK + [choice.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    second = client.chat.completions.create(model=_model(client), messages=turn2, tools=[WEATHER],
                                            max_tokens=8, temperature=0)
    previous = full.usage.prompt_tokens + full.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= 0.9 * previous


def test_response_format_json_schema(client):
    import json

    import jsonschema
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    out = client.chat.completions.create(
        model=_model(client), messages=ASK, max_tokens=80, temperature=1.0, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema,
                                                                "strict": True}})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
