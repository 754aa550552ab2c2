"""Recurrent models serve conversation trees from their state snapshots (issue 62, acceptance 4).

A Mamba-2 or Gated DeltaNet layer's state is known only where a snapshot of it was
kept, so a hybrid model's prefix-cache hit is the longest snapshot a prompt extends
(model/state_pool.py). Hypothesis draws conversation trees as agents and chat apps
make them: roots sharing one system prompt, turns that go on from an earlier turn's
prompt and answer, answers written back as the model wrote them or re-rendered (the
reasoning dropped, a call's text spelt otherwise), and the requests run one after
another through an engine with the prefix cache and one without. Each request must
  - give the cache-free engine's greedy tokens;
  - get exactly the hit the snapshot policy promises, worked out here from the tokens
    alone: a state is kept at each earlier request's last prompt block boundary, its
    last computed boundary, and the boundary where its prompt parted from the requests
    before it (when past its own hit);
and the KV-cache tokens recomputed for want of a snapshot are what the engine counts
as `prefix_cache_state_miss_tokens`.
"""
from __future__ import annotations

import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guided import LLM, SamplingParams
from helpers.tiny_models import VOCAB, build

BLOCK = 4


@pytest.fixture(scope="module", params=["granitemoehybrid_mamba", "qwen3_5", "falcon_h1"])
def model(request):
    directory = tempfile.mkdtemp()
    build(request.param, directory)
    plain = LLM(directory, dtype="float32", enable_prefix_caching=False, block_size=BLOCK)
    yield directory, plain
    plain.close()


def _tokens(draw, n_min: int, n_max: int) -> list[int]:
    return draw(st.lists(st.integers(0, VOCAB - 4), min_size=n_min, max_size=n_max))


@st.composite
def trees(draw):
    """Requests as (parent index or None, how the parent's answer is written back, new tokens,
    max_tokens); the prompts are built as the answers come (``_prompt``)."""
    system = _tokens(draw, 6, 30)
    turns = []
    for i in range(draw(st.integers(3, 8))):
        parent = draw(st.sampled_from([None, None, *range(i)]))
        rendering = draw(st.sampled_from(["as written", "reasoning dropped", "spelt otherwise"]))
        turns.append((parent, rendering, draw(st.integers(0, 6)), _tokens(draw, 1, 12), draw(st.integers(1, 12))))
    return system, turns


def _prompt(system, turns, prompts, answers, i) -> list[int]:
    parent, rendering, cut, new, _ = turns[i]
    if parent is None:
        return system + new
    answer = list(answers[parent])
    if rendering == "reasoning dropped":
        answer = answer[min(cut, len(answer) - 1):]
    elif rendering == "spelt otherwise":
        answer = answer[:cut] + [(t + 1) % (VOCAB - 3) for t in answer[cut:]]
    return prompts[parent] + answer + new


def _boundaries(tokens: list[int], upto: int) -> set[tuple[int, ...]]:
    return {tuple(tokens[:j * BLOCK]) for j in range(1, upto // BLOCK + 1)}


def _longest(prompt: list[int], prefixes: set[tuple[int, ...]], below: int = 0) -> int:
    """The longest block boundary of `prompt` (before its last token, above `below`) in `prefixes`."""
    for j in range((len(prompt) - 1) // BLOCK, below // BLOCK, -1):
        if tuple(prompt[:j * BLOCK]) in prefixes:
            return j * BLOCK
    return 0


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=trees())
def test_every_turn_gets_the_longest_state_kept_and_the_cache_free_answer(model, tree):
    directory, plain = model
    system, turns = tree
    llm = LLM(directory, dtype="float32", block_size=BLOCK, max_num_seqs=32, kv_cache_tokens=4096)
    prompts, answers = [], []
    kept: set[tuple[int, ...]] = set()        # where a state snapshot is, by the policy
    seen: set[tuple[int, ...]] = set()        # block prefixes of the requests so far
    computed: set[tuple[int, ...]] = set()    # block prefixes in the KV cache
    missed = 0
    for i, turn in enumerate(turns):
        prompt = _prompt(system, turns, prompts, answers, i)
        params = SamplingParams(max_tokens=turn[-1], temperature=0, ignore_eos=True)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        answer = list(out.outputs[0].token_ids)
        assert answer == list(want), f"turn {i}: the cache changed the answer"
        hit = _longest(prompt, kept)
        assert out.num_cached_tokens == hit, f"turn {i} of {turns}: hit {out.num_cached_tokens}, kept {hit}"
        missed += _longest(prompt, computed) - hit
        # what this request leaves: its states where it parted from the earlier ones, at its
        # prompt's last boundary and at the last boundary it computed (its last token is not)
        blocks = (len(prompt) - 1) // BLOCK * BLOCK
        parted = _longest(prompt, seen, below=hit)
        if parted and parted < blocks:
            kept.add(tuple(prompt[:parted]))
        tokens = prompt + answer
        last = (len(tokens) - 1) // BLOCK * BLOCK
        kept |= {tuple(prompt[:blocks]), tuple(tokens[:last])} - {()}
        seen |= _boundaries(tokens, len(tokens))
        computed |= _boundaries(tokens, len(tokens) - 1)
        prompts.append(prompt)
        answers.append(answer)
    assert llm.stats()["prefix_cache_state_miss_tokens"] == missed
    llm.close()


def test_a_shared_system_prompt_is_computed_twice_then_served():
    """The first of many questions under one system prompt keeps no state inside it; the
    second copies its state where it parts from the first; every later one starts there."""
    directory = tempfile.mkdtemp()
    build("granitemoehybrid_mamba", directory)
    llm = LLM(directory, dtype="float32", block_size=BLOCK, kv_cache_tokens=4096)
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(0, VOCAB - 3, (4 * BLOCK + 2,), generator=gen).tolist()
    params = SamplingParams(max_tokens=3, temperature=0)
    hits = [llm.generate([system + [i] * 5], params, use_tqdm=False)[0].num_cached_tokens for i in range(5)]
    assert hits == [0, 0, 4 * BLOCK, 4 * BLOCK, 4 * BLOCK]
    llm.close()
