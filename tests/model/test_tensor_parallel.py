"""Tensor parallelism over torch.distributed (gloo, two processes of one
thread each on this machine): the default model split over two ranks gives
exactly the tokens the whole model gives in float32, free, under a JSON
schema and under a tool grammar; settings that cannot work fail before any
process starts; closing leaves no rank behind.

SmolLM2-135M has 9 query heads over 3 KV heads: two ranks hold 2 + 1 KV-head
groups, so the uneven split is what is checked here."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jsonschema
import pytest

from guided import LLM, SamplingParams
from guided.processes import free_port
from helpers.prompts import PROMPTS

# the README's prompts, and the parity prompts
FREE = ["The capital of France is", "A JSON object:", *PROMPTS]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}]
CHATS = [[{"role": "user", "content": "What is the weather in Paris?"}],
         [{"role": "user", "content": "Name three colours."}]]


@pytest.fixture(scope="module")
def tp2():
    llm = LLM(dtype="float32", tensor_parallel_size=2, kv_cache_tokens=8192)
    yield llm
    llm.close()


def _runs(llm: LLM) -> dict:
    greedy = SamplingParams(temperature=0, max_tokens=40)
    schema = SamplingParams(temperature=0, max_tokens=48, structured_outputs={"json": PERSON})
    tool = SamplingParams(temperature=0, max_tokens=64)
    free = llm.generate(FREE, greedy, use_tqdm=False)
    json_out = llm.generate(["A person as JSON:", "Describe Ada Lovelace in JSON:"], schema,
                            use_tqdm=False)
    calls = llm.chat(CHATS, tool, use_tqdm=False, tools=TOOLS, tool_choice="required")
    return {"free": [o.outputs[0].token_ids for o in free],
            "json": [o.outputs[0].token_ids for o in json_out],
            "json_text": [o.outputs[0].text for o in json_out],
            "tool": [o.outputs[0].token_ids for o in calls],
            "calls": [o.outputs[0].tool_calls for o in calls]}


def test_two_ranks_give_the_whole_models_greedy_tokens(llm, tp2):
    whole, split = _runs(llm), _runs(tp2)
    for kind in ("free", "json", "tool"):
        assert split[kind] == whole[kind], kind
    # the plain-text prompts run to max_tokens: no early end hides a difference
    assert [len(split["free"][i]) for i in (1, 4)] == [40] * 2
    for text in split["json_text"]:
        jsonschema.validate(json.loads(text), PERSON)
    for calls in split["calls"]:
        assert calls, "tool_choice=required gave no call"
        for call in calls:
            assert call["function"]["name"] == "get_weather"
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                TOOLS[0]["function"]["parameters"])


def test_the_kv_cache_is_split_by_heads_and_each_rank_reports_its_steps(tp2):
    group = tp2.loaded.tensor_group
    assert (group.rank, group.size, group.backend) == (0, 2, "gloo")
    assert list(group.split.kv_heads) == [0, 1] and list(group.split.heads) == list(range(6))
    k_cache, _ = tp2.engine.runner.kv_caches[0]
    assert k_cache.shape[2] == 2   # this rank's 2 of the model's 3 KV heads
    assert tp2.engine.runner.num_blocks == 8192 // 16
    # the server's /metrics reads every rank's forward passes (rank 1 reports each second)
    from prometheus_client import generate_latest
    from guided.serve.metrics import Metrics
    tp2.generate("Hello", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    (_, steps0, _), (rank1, steps1, seconds1) = group.rank_stats()
    assert rank1 == 1 and 0 < steps1 <= steps0 and seconds1 > 0
    text = generate_latest(Metrics(dict, group.rank_stats).registry).decode()
    assert 'guided_tensor_parallel_steps_total{rank="1"}' in text


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel_size": 4}, "more than the model's 3 KV heads"),
    ({"tensor_parallel_size": 0}, "at least 1"),
    ({"tensor_parallel_size": 2, "dtype": "gguf"}, "dense weights"),
])
def test_settings_that_cannot_split_fail_before_any_rank_starts(kwargs, message, monkeypatch):
    started = []
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: started.append(a))
    with pytest.raises(ValueError, match=message):
        LLM(**kwargs)
    assert not started


def test_a_world_size_other_than_the_tensor_parallel_size_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ValueError, match="WORLD_SIZE=3 is not tensor_parallel_size=2"):
        LLM(dtype="float32", tensor_parallel_size=2)


def test_idle_heartbeats_keep_the_ranks_in_step(llm, tp2):
    group = tp2.loaded.tensor_group
    for _ in range(3):
        group.beat_if_idle(0)   # what rank 0 sends every 30 s while no request runs
    params = SamplingParams(temperature=0, max_tokens=8)
    split, whole = (x.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0].token_ids
                    for x in (tp2, llm))
    assert split == whole and group.broken is None


def test_one_group_per_process_and_close_stops_every_rank(tp2):
    """It closes the module's group: the next test forms another."""
    with pytest.raises(RuntimeError, match="already has a torch.distributed group"):
        LLM(dtype="float32", tensor_parallel_size=2)
    workers = list(tp2.loaded.tensor_group.workers)
    assert [w.poll() for w in workers] == [None]
    tp2.close()
    assert [w.returncode for w in workers] == [0]


def test_ranks_started_by_hand_meet_through_env_variables(llm, tp2, monkeypatch):
    """Several hosts' way, on loopback: rank 1 is `python -m guided.serve` started
    with the env:// variables (as torchrun would), rank 0 this process; rank 1
    takes what to load from rank 0 and the tokens are the whole model's."""
    tp2.close()   # one group per process
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    rank1 = subprocess.Popen([sys.executable, "-m", "guided.serve", "--tensor-parallel-size", "2",
                              "--log-level", "warning"],
                             env={**os.environ, **env, "RANK": "1", "OMP_NUM_THREADS": "1"})
    try:
        for name, value in {**env, "RANK": "0"}.items():
            monkeypatch.setenv(name, value)
        split = LLM(dtype="float32", tensor_parallel_size=2, kv_cache_tokens=1024)
        assert split.loaded.tensor_group.workers == []   # started by hand, not here
        params = SamplingParams(temperature=0, max_tokens=12)
        ours = split.generate(PROMPTS[:1], params, use_tqdm=False)
        whole = llm.generate(PROMPTS[:1], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in whole]
        split.close()
        assert rank1.wait(timeout=30) == 0
    finally:
        if rank1.poll() is None:
            rank1.kill()


def test_a_rank_that_dies_while_loading_is_named(tp2, monkeypatch):
    """Rank 0 does not wait for a rank that is gone; the engine is not built."""
    tp2.close()   # one group per process
    monkeypatch.setattr(sys, "executable", "/bin/false")   # rank 1 exits at once, with 1
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 exited with 1 while loading"):
        LLM(dtype="float32", tensor_parallel_size=2, kv_cache_tokens=1024)
