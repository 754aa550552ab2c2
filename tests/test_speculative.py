"""Speculative decoding (rust/engine/speculative.rs): drafts looked up in the
conversation, chosen by the grammar and checked in one forward pass, change
no token of any output, greedy or seeded, whatever the batch, the cache or
preemption; they leave the prefix cache as it was, and they are counted.

The drafts that must be refused (random tokens the grammar mostly forbids)
run the whole structured-output suite in tests/grammar/test_structured.py.
"""
from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest

from guided import LLM, SamplingParams
from guided.chat import ChatOptions
from guided.engine import Engine, EngineConfig
from helpers.structured import obj, validator
from helpers.tools import TOOLS

ORDER = ("Order #48213 was placed by Margaret Okonkwo-Lindqvist (margaret.okonkwo@example.org) "
         "on 2024-03-17 for 3 units of the Titanium Widget Pro XL, shipped to 1742 Evergreen "
         "Terrace, Springfield, Oregon 97477.")
ORDER_SCHEMA = obj({"order_id": {"type": "string"}, "customer": {"type": "string"},
                    "email": {"type": "string", "format": "email"}, "date": {"type": "string", "format": "date"},
                    "address": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}},
                   additionalProperties=False)


def _requests(temperature: float, fast_forward: bool) -> list[tuple[list[dict], SamplingParams, dict]]:
    """Eight chat requests: extractions whose values copy from the prompt, a
    required tool call copying the user's words, and free text (the control),
    each as (messages, params, chat options)."""
    def params(max_tokens: int, seed: int, **kw) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                              fast_forward=fast_forward, **kw)
    extract = [{"role": "user", "content": f"Extract the order as JSON.\n\n{ORDER}"}]
    flights = [{"role": "user", "content": "Find flights from SFO to JFK for 2 passengers, "
                                           "then from JFK to LHR for 2 passengers."}]
    free = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    poem = [{"role": "user", "content": "Repeat this line three times: the sea is calm tonight."}]
    return [
        (extract, params(100, 1, structured_outputs={"json": ORDER_SCHEMA}), {}),
        (extract, params(60, 2, structured_outputs={"json": {"type": "object"}}), {}),
        (flights, params(70, 3), {"tools": TOOLS, "tool_choice": "required"}),
        (free, params(32, 4), {}),
        (poem, params(40, 5), {}),
        (extract, params(60, 6), {}),
        ([{"role": "user", "content": f"Who placed this order? {ORDER}"}], params(30, 7), {}),
        (flights, params(50, 8), {"tools": TOOLS, "tool_choice": "auto"}),
    ]


def _run(llm: LLM, requests, speculative: bool) -> list:
    plans = [llm.prepare_chat(m, replace(p, speculative=speculative), ChatOptions(**o))
             for m, p, o in requests]
    return [o.outputs[0] for o in llm.run_chat(plans)]


@pytest.fixture(scope="module")
def default_llm():
    """The default model as users get it (quantized), speculation off unless asked."""
    return LLM(max_num_seqs=16, kv_cache_tokens=16384)


@pytest.mark.parametrize("which", ["default", "float32"])
def test_speculation_changes_no_token(which, default_llm, llm):
    """Greedy and seeded, fast-forward on and off, in one batch of 24 and
    alone: the same tokens with speculation as without, and drafts kept on
    the way."""
    engine_llm = default_llm if which == "default" else llm
    before = engine_llm.stats()
    requests = [r for t, ff in ((0.0, True), (0.0, False), (0.8, True)) for r in _requests(t, ff)]
    for batch in (requests[:1], requests):
        off, on = _run(engine_llm, batch, False), _run(engine_llm, batch, True)
        for (m, p, _), a, b in zip(batch, off, on):
            assert b.token_ids == a.token_ids, (which, len(batch), p)
            assert (b.finish_reason, b.num_forced_tokens) == (a.finish_reason, a.num_forced_tokens)
    stats = engine_llm.stats()
    kept = stats["draft_lookups_kept"] - before["draft_lookups_kept"]
    assert stats["draft_steps"] > before["draft_steps"] and kept > 50, stats
    # The extraction is valid JSON of its schema either way.
    validator(ORDER_SCHEMA).validate(json.loads(on[0].text))


def _fresh(llm: LLM, **config) -> LLM:
    """``llm``'s model behind an engine of its own (its own KV cache and
    scheduler), so that its prefix cache starts empty."""
    other = copy.copy(llm)
    other.engine = Engine(llm.loaded, EngineConfig(**config), llm.engine.special)
    return other


def test_the_prefix_cache_holds_the_same_blocks_with_speculation(default_llm):
    """Rejected draft tokens never enter the prefix cache, and kept ones do
    as their own tokens would: after the same requests, the cache holds the
    same blocks with speculation as without."""
    requests = _requests(0.0, True)
    stored = {}
    for speculative in (False, True):
        fresh = _fresh(default_llm, kv_cache_tokens=16384, block_size=16, speculative=speculative)
        fresh.engine.record_cache_events()
        outs = _run(fresh, requests, speculative)
        events = fresh.engine.take_cache_events()
        stored[speculative] = ({(h, p, tuple(t)) for kept, h, p, t in events if kept},
                               [o.token_ids for o in outs])
        if speculative:
            assert fresh.stats()["draft_lookups_kept"] > 0
        assert not [e for e in events if not e[0]], "nothing evicted: the cache is roomy"
    assert stored[True][1] == stored[False][1]
    assert stored[True][0] == stored[False][0]


def test_preemption_during_speculative_steps(default_llm):
    """A KV pool too small for the batch: sequences are preempted while
    others carry drafts (whose blocks never preempt anyone), and every
    output is the one a roomy engine gives without speculation."""
    requests = _requests(0.0, True)
    want = [o.token_ids for o in _run(_fresh(default_llm, kv_cache_tokens=16384), requests, False)]
    tight = _fresh(default_llm, kv_cache_tokens=640, block_size=16, max_num_seqs=8)
    got = [o.token_ids for o in _run(tight, requests, True)]
    stats = tight.stats()
    assert stats["preemptions"] > 0 and stats["draft_steps"] > 0, stats
    assert got == want
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_speculation_is_asked_per_request_or_engine_wide(default_llm):
    """SamplingParams.speculative overrides the engine's setting; a request
    that asks for logprobs never speculates; a bad value is refused where
    it enters."""
    requests = _requests(0.0, True)[4:5]   # a line to repeat: drafts pay at any row cost
    on = _fresh(default_llm, kv_cache_tokens=4096, speculative=True)
    plan = on.prepare_chat(requests[0][0], requests[0][1], ChatOptions())
    on.run_chat([plan])
    assert on.stats()["draft_steps"] > 0
    off = _fresh(default_llm, kv_cache_tokens=4096, speculative=True)
    off.run_chat([off.prepare_chat(requests[0][0], replace(requests[0][1], speculative=False),
                                   ChatOptions())])
    with_logprobs = replace(requests[0][1], speculative=True, logprobs=2)
    off.run_chat([off.prepare_chat(requests[0][0], with_logprobs, ChatOptions())])
    assert off.stats()["draft_steps"] == 0
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="yes")
    with pytest.raises(ValueError, match="drafter"):
        _fresh(default_llm, kv_cache_tokens=4096, drafter="ngram")
