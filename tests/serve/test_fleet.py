"""`--replicas 2` behind vllm-router on loopback: concurrent multi-turn
tool conversations keep their replica's prefix cache through the router,
a replica killed mid-run is taken out while the other keeps answering, and
stopping the fleet leaves no process behind. Both replicas share this
machine's cores."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest

from helpers.live_server import free_port, get

TOOL_ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
             "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": TOOL_ARGS}}]


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_fleet(*extra: str):
    """(base URL, the parent process) of `--replicas 2` with ``extra`` options."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "guided.serve", "--replicas", "2", "--port", str(port),
                             "--kv-cache-tokens", "16384", "--max-num-seqs", "8", "--log-level", "warning",
                             *extra])
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    while True:
        assert proc.poll() is None, f"the fleet exited with {proc.returncode}"
        try:
            if get(base + "/health")[0] == 200:
                break
        except OSError:
            pass
        assert time.time() < deadline, "the fleet did not come up"
        time.sleep(0.5)
    return base, proc


@pytest.fixture(scope="module")
def fleet():
    """(base URL, the parent process) of `--replicas 2` (cache_aware routing)."""
    base, proc = _start_fleet()
    yield base, proc
    if proc.poll() is None:
        proc.kill()


def _conversation(client, model: str, i: int) -> list:
    """Three turns: two required calls with their results sent back, then an answer."""
    messages = [{"role": "system", "content": f"You are weather assistant number {i}. " * 40},
                {"role": "user", "content": f"What is the weather in city {i}?"}]
    turns = []
    for choice in ("required", "required", "none"):
        out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                             tool_choice=choice, max_tokens=48, temperature=0)
        turns.append(out)
        if choice == "none":
            break
        call = out.choices[0].message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), TOOL_ARGS)
        messages += [out.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    return turns


def _conversations_keep_their_cache(client, model: str) -> None:
    """4 concurrent 3-turn tool conversations: turns 2 and 3 find the previous turn in the cache."""
    with ThreadPoolExecutor(4) as pool:
        conversations = list(pool.map(lambda i: _conversation(client, model, i), range(4)))
    for turns in conversations:
        assert turns[-1].choices[0].message.content
        for before, after in zip(turns, turns[1:]):
            previous = before.usage.prompt_tokens + before.usage.completion_tokens
            cached = after.usage.prompt_tokens_details.cached_tokens
            assert cached >= 0.9 * previous, (cached, previous)


def test_conversations_keep_their_replica_cache(fleet):
    base, _ = fleet
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    _conversations_keep_their_cache(client, model)
    # the other APIs go through the router too
    r = client.responses.create(model=model, input="Say hi", max_output_tokens=4)
    assert r.status in ("completed", "incomplete")


def test_a_killed_replica_is_taken_out_and_stopping_leaves_nothing(fleet):
    base, proc = fleet
    children = _children(proc.pid)
    replicas = [p for p in children if "guided.serve" in _cmdline(p)]
    # the router (it renames its process: setproctitle) is the third
    assert len(replicas) == 2 and len(children) == 3, [_cmdline(p) for p in children]
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    os.kill(replicas[0], signal.SIGKILL)
    for i in range(6):
        out = client.chat.completions.create(model=model, max_tokens=4, temperature=0,
                                             messages=[{"role": "user", "content": f"Count to {i + 3}."}])
        assert out.choices[0].finish_reason in ("length", "stop")
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(p) for p in children):
        time.sleep(0.2)
    assert not [p for p in children if _alive(p)], "a process of the fleet was left running"


def _samples(text: str) -> dict[str, list]:
    from prometheus_client.parser import text_string_to_metric_families
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_kv_aware_routes_by_the_replicas_cache_events_in_one_metrics_view():
    """--router-policy kv_aware: the router reads each replica's KV events
    (its placement lookups hit) and keeps conversations on their cache;
    --metrics-port shows the router's and both replicas' metrics at once."""
    metrics = free_port()
    base, proc = _start_fleet("--router-policy", "kv_aware", "--metrics-port", str(metrics))
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        _conversations_keep_their_cache(client, model)
        status, body = get(f"http://127.0.0.1:{metrics}/metrics")
        assert status == 200
        families = _samples(body.decode() if isinstance(body, bytes) else body)
        hits = [x for x in families["vllm_router_kv_placement_lookups"]
                if x.labels.get("result") == "hit" and x.labels["source"] == "router"]
        assert hits and hits[0].value > 0, "the router found nothing from the replicas' events"
        up = {x.labels["replica"]: x.value for x in families["guided_fleet_replica_up"]}
        assert up == {"0": 1.0, "1": 1.0}
        prompts = {x.labels["replica"]: x.value for x in families["guided_prompt_tokens"]
                   if x.name.endswith("_total")}
        assert set(prompts) == {"0", "1"} and sum(prompts.values()) > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
