"""Decode steps in batch-size buckets (model/decode_graphs.py), without a GPU:
the buckets and static buffers a CUDA graph reads, run eagerly over the
reference kernels ("padded"; on CUDA "auto" captures the same forward).

- The buffers: over generated sequences of decode steps, each step's rows
  reach the forward as the plan gave them, whatever a larger step left in
  the buffers, and every row past them is padding on the pad block.
- The engine: the default model answers a batch that shrinks through every
  bucket (greedy, seeded sampling, a JSON schema, twice over on one engine)
  with the tokens and log-probabilities of eager steps, to the bit.
- A mode that cannot run is refused by name.
- On a GPU (benches/gpu/run.sh): the captured graphs give what the same
  buckets give eagerly, to the bit.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from guided import LLM, SamplingParams, StructuredOutputsParams
from guided.model import cuda_ops
from guided.model.decode_graphs import DecodeGraphs, buckets

BLOCK, PAD_BLOCK, MAX_BLOCKS = 4, 99, 6


@given(st.integers(1, 512))
def test_every_batch_has_the_smallest_bucket_that_holds_it(max_batch):
    sizes = buckets(max_batch)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_batch
    for n in range(1, max_batch + 1):
        bucket = next(b for b in sizes if b >= n)
        assert bucket - n < 8 and bucket < 2 * n   # padding wastes under 8 rows and under half the bucket


def _plan(rows: list[tuple[int, list[int]]]) -> SimpleNamespace:
    """A decode step: per sequence (context length, its block table)."""
    width = max(len(t) for _, t in rows)
    n = len(rows)
    return SimpleNamespace(
        seq_ids=np.arange(n, dtype=np.int64), num_tokens=n, is_decode_only=True,
        logits_indices=np.arange(n, dtype=np.int64),
        input_ids=np.array([1000 + 7 * i for i in range(n)], dtype=np.int64),
        positions=np.array([ctx - 1 for ctx, _ in rows], dtype=np.int64),
        slot_mapping=np.array([t[(ctx - 1) // BLOCK] * BLOCK + (ctx - 1) % BLOCK for ctx, t in rows], dtype=np.int64),
        block_tables=np.array([t + [0] * (width - len(t)) for _, t in rows], dtype=np.int32),
        context_lens=np.array([ctx for ctx, _ in rows], dtype=np.int32))


decode_steps = st.lists(st.lists(st.integers(1, MAX_BLOCKS * BLOCK).flatmap(
    lambda ctx: st.tuples(st.just(ctx), st.lists(st.integers(0, 98), min_size=-(-ctx // BLOCK),
                                                 max_size=-(-ctx // BLOCK)))), min_size=1, max_size=12),
    min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(steps=decode_steps)
def test_each_step_reaches_the_forward_as_planned_and_padded(steps):
    seen = []

    def forward(ids, positions, meta):   # what a captured graph would read, row by row
        seen.append([t.clone() for t in (ids, positions, meta.slot_mapping, meta.block_tables,
                                         meta.context_lens, meta.query_start_loc)])
        return torch.stack([ids, positions, meta.context_lens.long()], dim=1).float()

    graphs = DecodeGraphs(forward, torch.device("cpu"), max_batch=10, max_blocks=MAX_BLOCKS, block_size=BLOCK,
                          pad_block=PAD_BLOCK, max_context_len=MAX_BLOCKS * BLOCK, kernels=False,
                          native_only=False, capture=False)
    for rows in steps:
        plan = _plan(rows)
        bucket = graphs.bucket(plan)
        if len(rows) > 10:
            assert bucket is None
            continue
        n = len(rows)
        out = graphs.run(plan, bucket)
        ids, positions, slots, tables, lens, starts = seen[-1]
        assert len(ids) == bucket == next(b for b in buckets(10) if b >= n)
        assert out.shape == (n, 3)
        assert out[:, 0].long().tolist() == plan.input_ids.tolist()
        assert positions[:n].tolist() == plan.positions.tolist() and slots[:n].tolist() == plan.slot_mapping.tolist()
        assert lens[:n].tolist() == plan.context_lens.tolist() and starts.tolist() == list(range(bucket + 1))
        for r, (ctx, table) in enumerate(rows):   # the blocks a row's context covers
            assert tables[r, :len(table)].tolist() == table
        assert ids[n:].eq(0).all() and positions[n:].eq(0).all() and lens[n:].eq(1).all()
        assert slots[n:].eq(PAD_BLOCK * BLOCK).all() and tables[n:].eq(PAD_BLOCK).all()


def test_a_step_no_graph_holds_runs_eagerly():
    graphs = DecodeGraphs(lambda *a: None, torch.device("cpu"), max_batch=4, max_blocks=2, block_size=BLOCK,
                          pad_block=PAD_BLOCK, max_context_len=8, kernels=False, native_only=False, capture=False)
    assert graphs.bucket(_plan([(3, [1])] * 4)) == 4
    assert graphs.bucket(_plan([(3, [1])] * 5)) is None, "more sequences than the largest bucket"
    assert graphs.bucket(_plan([(12, [1, 2, 3])])) is None, "a table wider than the buffers'"
    mixed = _plan([(3, [1])])
    mixed.is_decode_only = False
    assert graphs.bucket(mixed) is None, "a prefill or mixed step"


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}


def _requests():
    prompts = [f"<|im_start|>user\nDescribe city number {i} in one line.<|im_end|>\n<|im_start|>assistant\n"
               for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=2, ignore_eos=True) for n in (2, 5, 9, 14)]
    params.append(SamplingParams(temperature=1.0, seed=11, max_tokens=20, logprobs=2, ignore_eos=True))
    params.append(SamplingParams(temperature=0, max_tokens=40, logprobs=2,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    return prompts, params


def _answers(llm: LLM) -> list:
    prompts, params = _requests()
    return [[(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
             for o in llm.generate(prompts, params)] for _ in range(2)]


def test_padded_decode_steps_change_no_token_or_logprob(default_gguf):
    """Six requests of different lengths: the batch shrinks from 6 to 1 through
    buckets 6, 4, 2 and 1 (max_num_seqs=6), on the torch step with the
    reference kernels; the second round runs on buffers the first left."""
    eager = _answers(LLM(default_gguf, cpu_step="torch", cuda_graphs="off", max_num_seqs=6))
    padded_llm = LLM(default_gguf, cpu_step="torch", cuda_graphs="padded", max_num_seqs=6)
    padded = _answers(padded_llm)
    assert padded == eager
    steps = padded_llm.engine.runner.graphs.steps
    assert set(steps) == {1, 2, 4, 6}, f"every bucket ran: {dict(steps)}"
    tokens = padded[0][-1][0]
    jsonschema.validate(json.loads(padded_llm.loaded.tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMA)


def test_a_mode_that_cannot_run_is_refused_by_name(default_gguf):
    with pytest.raises(ValueError, match="cuda_graphs='eager': one of auto, off, padded"):
        LLM(default_gguf, cuda_graphs="eager")
    with pytest.raises(ValueError, match="this CPU step is native"):
        LLM(default_gguf, cuda_graphs="padded")   # a GGUF runs the native step by default
    assert LLM(default_gguf).engine.runner.graphs is None, "graphs are a CUDA matter: none on a CPU by default"


@pytest.mark.skipif(not (cuda_ops.status()[0] and torch.cuda.is_available()), reason="no GPU with guided's kernels here")
def test_gpu_captured_graphs_give_the_padded_steps_answers(default_gguf):
    """The same buckets replayed from CUDA graphs and run eagerly: the same
    kernels on the same shapes, so the same bits."""
    runs = {}
    for mode in ("auto", "padded"):
        llm = LLM(default_gguf, device="cuda", dtype="bfloat16", cuda_graphs=mode, max_num_seqs=6,
                  kv_cache_tokens=4096)
        runs[mode] = _answers(llm)
        if mode == "auto":
            assert set(llm.engine.runner.graphs.graphs) == {1, 2, 4, 6}, "a graph per bucket"
    assert runs["auto"] == runs["padded"]
