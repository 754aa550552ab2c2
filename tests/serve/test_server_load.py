"""The server under load: many concurrent streams of mixed kinds, clients
that go away mid-stream, and a bounded queue that answers 503."""
from __future__ import annotations

import asyncio
import json
import time

import jsonschema
import openai

from helpers.live_server import API_KEY, metric

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "rain": {"type": "boolean"}},
          "required": ["city", "rain"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]


async def _stream(client, model, kind: str, seed: int) -> dict:
    extra = {"json": {"response_format": {"type": "json_schema", "json_schema": {
                 "name": "w", "schema": SCHEMA}}},
             "tool": {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False},
             "free": {}}[kind]
    content, args, reasons = "", "", []
    stream = await client.chat.completions.create(model=model, messages=ASK, max_tokens=48,
                                                  temperature=1.0, seed=seed, stream=True, **extra)
    async for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                args += d.function.arguments or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return {"kind": kind, "content": content, "args": args, "reasons": reasons}


def _check(r: dict) -> None:
    assert len(r["reasons"]) == 1, r
    if r["kind"] == "json":
        jsonschema.validate(json.loads(r["content"]), SCHEMA)
    elif r["kind"] == "tool":
        assert r["reasons"] == ["tool_calls"], r
        jsonschema.validate(json.loads(r["args"]), WEATHER["function"]["parameters"])
    else:
        assert r["reasons"][0] in ("stop", "length") and "<|im_end|>" not in r["content"]


def test_64_concurrent_mixed_streams(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0,
                                    timeout=600)
        model = (await client.models.list()).data[0].id
        kinds = ["free", "json", "tool"] * 22
        return await asyncio.gather(*(_stream(client, model, k, i)
                                      for i, k in enumerate(kinds[:64])))
    results = asyncio.run(main())
    assert len(results) == 64
    for r in results:
        _check(r)


def test_clients_leaving_mid_stream_free_their_blocks(server):
    idle = metric(server, "guided_kv_cache_usage_ratio")

    async def leave(client, model, i):
        stream = await client.completions.create(model=model, prompt=f"Story number {i}:",
                                                 max_tokens=400, temperature=1.0, seed=i,
                                                 stream=True, extra_body={"ignore_eos": True})
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.close()

    async def main():
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0)
        model = (await client.models.list()).data[0].id
        await asyncio.gather(*(leave(client, model, i) for i in range(8)))
    asyncio.run(main())
    deadline = time.time() + 30
    while time.time() < deadline and (metric(server, "guided_num_running") != 0.0 or
                                      metric(server, "guided_kv_cache_usage_ratio") != idle):
        time.sleep(0.2)
    assert metric(server, "guided_num_running") == 0.0
    assert metric(server, "guided_kv_cache_usage_ratio") == idle


def test_bounded_queue_answers_503_and_serves_the_rest(small_server):
    async def one(client, model, i):
        try:
            out = await client.completions.create(model=model, prompt=f"Count {i}:", max_tokens=24,
                                                  temperature=0, extra_body={"ignore_eos": True})
            return out.choices[0].finish_reason
        except openai.APIStatusError as err:
            assert err.status_code == 503 and err.response.headers.get("retry-after"), err
            return 503

    async def main(base):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        model = (await client.models.list()).data[0].id
        return await asyncio.gather(*(one(client, model, i) for i in range(16)))
    results = asyncio.run(main(small_server))
    # 6 fit (2 running + 4 waiting); the rest arrive while those still run
    assert results.count(503) >= 8
    assert results.count("length") == 16 - results.count(503) and results.count("length") >= 6
