"""Every budget, every API: a schema answer and a required tool call sent
with max_tokens from 1 to the shortest complete output + 8, over chat
completions, completions, Responses and Messages. No answer is a 5xx;
a request whose shortest complete output cannot fit is a 400 in the API's
own error shape naming max_tokens; one that can fit is never refused (a
budget accepted, every larger one is too); every accepted answer is whole:
its JSON validates, its call names the tool with arguments that validate,
and it ends as the model's own end would ("stop", "tool_calls",
"completed", "end_turn"/"tool_use")."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from helpers.live_server import API_KEY, post

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {
        "type": "string"}, "minItems": 1}},
    "required": ["name", "age", "email", "tags"]}
#: a tool as people write them: no additionalProperties, an enum, a pattern
BOOK = {"type": "object", "properties": {
    "city": {"type": "string", "description": "the city"},
    "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    "rooms": {"type": "integer", "minimum": 1}, "kind": {"enum": ["single", "double"]}},
    "required": ["city", "date", "rooms", "kind"]}
ASK = "Book a double room in Paris for 2026-12-01 and describe a person as JSON, at length."
EXTRA = 8


def _chat(kind: str, budget: int) -> tuple[str, dict]:
    body = {"model": "served", "max_tokens": budget, "temperature": 1.0, "seed": budget,
            "messages": [{"role": "user", "content": ASK}]}
    if kind == "schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    else:
        body["tools"] = [{"type": "function", "function": {"name": "book", "parameters": BOOK}}]
        body["tool_choice"] = "required"
    return "/v1/chat/completions", body


def _completions(kind: str, budget: int) -> tuple[str, dict]:
    schema = PERSON if kind == "schema" else BOOK
    return "/v1/completions", {"model": "served", "prompt": ASK + "\n", "max_tokens": budget,
                               "temperature": 1.0, "seed": budget,
                               "structured_outputs": {"json": schema}}


def _responses(kind: str, budget: int) -> tuple[str, dict]:
    body = {"model": "served", "input": ASK, "max_output_tokens": budget, "temperature": 1.0,
            "seed": budget, "store": False}
    if kind == "schema":
        body["text"] = {"format": {"type": "json_schema", "name": "p", "schema": PERSON}}
    else:
        body["tools"] = [{"type": "function", "name": "book", "parameters": BOOK}]
        body["tool_choice"] = "required"
    return "/v1/responses", body


def _messages(kind: str, budget: int) -> tuple[str, dict]:
    body = {"model": "served", "max_tokens": budget, "temperature": 1.0,
            "messages": [{"role": "user", "content": ASK}]}
    if kind == "schema":
        body["output_config"] = {"format": {"type": "json_schema", "schema": PERSON}}
    else:
        body["tools"] = [{"name": "book", "input_schema": BOOK}]
        body["tool_choice"] = {"type": "any"}
    return "/v1/messages", body


def _whole(api: str, kind: str, out: dict) -> str | None:
    """Why ``out`` is not a whole answer (None: it is)."""
    schema = PERSON if kind == "schema" else BOOK
    if api == "chat":
        choice = out["choices"][0]
        msg = choice["message"]
        values = ([json.loads(c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
                  if kind == "tool" else [json.loads(msg["content"])])
        ended = choice["finish_reason"] == ("tool_calls" if kind == "tool" else "stop")
    elif api == "completions":
        choice = out["choices"][0]
        values, ended = [json.loads(choice["text"])], choice["finish_reason"] == "stop"
    elif api == "responses":
        items = out["output"]
        values = ([json.loads(i["arguments"]) for i in items if i["type"] == "function_call"]
                  if kind == "tool" else
                  [json.loads(p["text"]) for i in items if i["type"] == "message" for p in i["content"]])
        ended = out["status"] == "completed"
    else:
        blocks = out["content"]
        values = ([b["input"] for b in blocks if b["type"] == "tool_use"] if kind == "tool" else
                  [json.loads(b["text"]) for b in blocks if b["type"] == "text"])
        ended = out["stop_reason"] == ("tool_use" if kind == "tool" else "end_turn")
    if not values:
        return "no value"
    for v in values:
        jsonschema.validate(v, schema, format_checker=jsonschema.FormatChecker())
    return None if ended else "not ended as the model would"


APIS = {"chat": _chat, "completions": _completions, "responses": _responses, "messages": _messages}


@pytest.mark.parametrize("kind", ["schema", "tool"])
def test_every_budget_is_refused_with_a_400_or_answered_whole(server, kind):
    def one(api: str, budget: int):
        path, body = APIS[api](kind, budget)
        status, _, text = post(server + path, json.dumps(body).encode(), API_KEY)
        return api, budget, status, json.loads(text)

    # the shortest output, as the 400 at budget 1 says it
    needs = {}
    for api in APIS:
        _, _, status, body = one(api, 1)
        assert status == 400, (api, body)
        needs[api] = int(re.search(r"needs (\d+) tokens", json.dumps(body)).group(1))
    jobs = [(api, b) for api in APIS for b in range(2, needs[api] + EXTRA + 1)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda job: one(*job), jobs))
    bad, accepted = [], {api: [] for api in APIS}
    for api, budget, status, body in results:
        if status == 400:
            error = body.get("error", {})
            message = error.get("message", "")
            if "max_tokens" not in message or (api == "messages") != (body.get("type") == "error"):
                bad.append((api, budget, status, body))
            continue
        if status != 200:
            bad.append((api, budget, status, body))
            continue
        accepted[api].append(budget)
        try:
            why = _whole(api, kind, body)
        except (ValueError, KeyError, jsonschema.ValidationError) as exc:
            why = str(exc)[:200]
        if why:
            bad.append((api, budget, why, json.dumps(body)[:400]))
    assert not bad, "\n".join(map(str, bad))
    for api, budgets in accepted.items():
        # the first budget that fits is at most the shortest output; every larger one is taken
        assert budgets and min(budgets) <= needs[api], (api, needs[api], budgets)
        assert budgets == list(range(min(budgets), needs[api] + EXTRA + 1)), (api, budgets)
