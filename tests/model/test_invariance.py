"""One request, one answer: a greedy request's tokens do not depend on the
batch it shares, the chunks its prompt was prefilled in, or what other
requests left in the prefix cache.

On the CPU this rests on two things, each tested here: the attention over the
paged cache (rust/cpu/cpu_attention.rs) computes every query row on its own, and the
quantized default's linears take ggml's 8-bit kernel for every row count
(model/quant_linear.py). The end-to-end test runs the default model as a
user gets it.
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from guided import LLM, SamplingParams, _native
from guided.model import cuda_ops
from guided.model.attention import (KERNEL_QUERY_TOKENS, AttentionMetadata, AttentionPlan, Scores,
                                    paged_attention)
from helpers.prompts import PROMPTS, chat

BLOCK = 4
HEADS, KV_HEADS, HEAD = 6, 2, 24
NUM_BLOCKS = 64


def _metadata(seqs: list[tuple[int, int]], tables: list[list[int]], kernels: bool = False) -> AttentionMetadata:
    """(context length, new rows) per sequence; the new rows are its last ones."""
    starts = [0]
    for _, new in seqs:
        starts.append(starts[-1] + new)
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long),   # K/V are in the cache already
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(n for _, n in seqs), max_context_len=max(c for c, _ in seqs),
        block_size=BLOCK, is_decode_only=all(n == 1 for _, n in seqs), kernels=kernels)


steps = st.lists(st.integers(1, 60).flatmap(lambda ctx: st.tuples(st.just(ctx), st.integers(1, ctx))),
                 min_size=1, max_size=4)


@settings(max_examples=40, deadline=None)
@given(seqs=steps, window=st.sampled_from([None, 5, 17]), softcap=st.sampled_from([None, 3.0]),
       sinks=st.booleans(), bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_native_attention_is_torchs_and_each_row_its_own(seqs, window, softcap, sinks, bf16, seed):
    """Any mix of prefill chunks and decodes, windows, soft-caps, sinks, f32 or
    bf16 caches: the native CPU attention gives what torch's SDPA path gives
    (on the caches' values in f32),
    and each sequence's rows are, to the bit, what they are with the sequence
    alone in the step."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    k_cache, v_cache = (torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD, generator=gen).to(dtype) for _ in "kv")
    free = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()   # block 0 pads the tables
    tables = [[free.pop() for _ in range(-(-ctx // BLOCK))] for ctx, _ in seqs]
    q = torch.randn(sum(n for _, n in seqs), HEADS, HEAD, generator=gen)
    scores = Scores(scale=HEAD ** -0.5, window=window, softcap=softcap)
    sink = torch.randn(HEADS, generator=gen) if sinks else None
    attn = _metadata(seqs, tables)
    native = paged_attention(q, k_cache, v_cache, AttentionPlan(attn, q.device), scores, sink)
    # torch's path reads bf16 caches in bf16 arithmetic; the native kernel widens them to f32
    by_torch = paged_attention(q, k_cache.float(), v_cache.float(), AttentionPlan(attn, q.device, native=False),
                               scores, sink)
    torch.testing.assert_close(native, by_torch, atol=1e-5, rtol=1e-4)
    start = 0
    for (ctx, new), table in zip(seqs, tables):
        alone = paged_attention(q[start:start + new], k_cache, v_cache,
                                AttentionPlan(_metadata([(ctx, new)], [table]), q.device), scores, sink)
        assert torch.equal(alone, native[start:start + new])
        start += new


def _reference_kernel(q, k_cache, v_cache, tables, lens, scale, out=None, *, window=None, softcap=None,
                      sinks=None):
    """cuda_ops.paged_decode's algorithm on the CPU (rust/cuda/reference.rs)."""
    got = _native.reference_paged_decode(q.float().numpy(), k_cache.float().numpy(), v_cache.float().numpy(),
                                         tables.numpy(), lens.numpy(), scale, window or 0, softcap or 0.0,
                                         None if sinks is None else sinks.numpy())
    return torch.from_numpy(got).to(q.dtype)


@settings(max_examples=40, deadline=None)
@given(seqs=steps, window=st.sampled_from([None, 5, 17]), softcap=st.sampled_from([None, 3.0]),
       sinks=st.booleans(), seed=st.integers(0, 2**16))
def test_where_the_kernels_run_short_rows_of_a_mixed_step_take_the_decode_kernel(seqs, window, softcap,
                                                                                   sinks, seed):
    """On CUDA a step's sequences with at most KERNEL_QUERY_TOKENS new tokens
    (a decode, tokens a grammar forced, a short chunk) attend through the
    decode kernel, one query row per token with its own context length; the
    rest through SDPA. With the kernel's CPU reference standing in for it,
    that gives what the torch path gives, rows in place."""
    head = 64
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, head, generator=gen) for _ in "kv")
    free = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    tables = [[free.pop() for _ in range(-(-ctx // BLOCK))] for ctx, _ in seqs]
    q = torch.randn(sum(n for _, n in seqs), HEADS, head, generator=gen)
    scores = Scores(scale=head ** -0.5, window=window, softcap=softcap)
    sink = torch.randn(HEADS, generator=gen) if sinks else None
    plan = AttentionPlan(_metadata(seqs, tables, kernels=True), q.device, native=False, head_dim=head)
    short = sum(n for _, n in seqs if n <= KERNEL_QUERY_TOKENS)
    assert (plan.kernel_decode is not None) == (short > 0)
    assert len(plan.prefills) == sum(n > KERNEL_QUERY_TOKENS for _, n in seqs)
    with mock.patch.object(cuda_ops, "paged_decode", _reference_kernel):
        got = paged_attention(q, k_cache, v_cache, plan, scores, sink)
    want = paged_attention(q, k_cache, v_cache, AttentionPlan(_metadata(seqs, tables), q.device, native=False),
                           scores, sink)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_native_attention_refuses_a_table_naming_a_missing_block():
    k = torch.zeros(2, BLOCK, 1, 8)
    attn = _metadata([(3, 1)], [[5]])
    with pytest.raises(ValueError, match="block 5"):
        paged_attention(torch.zeros(1, 2, 8), k, k, AttentionPlan(attn, torch.device("cpu")), Scores(1.0))


SYSTEM = "<|im_start|>system\nYou are Guide, a helpful assistant. Answer briefly and precisely.<|im_end|>\n"
#: the README's questions behind one system prompt (so they share cached blocks), and the parity prompts
ASKS = [SYSTEM + chat(q) for q in ("What is the capital of France?", "Name three prime numbers.",
                                   "How do I reverse a list in Python?", "What is 12 times 7?")] + PROMPTS
OTHER = chat("Tell me a long story about a dragon who learns to cook.")


@pytest.mark.skipif(_native.quant_kernels() is None, reason="no build of ggml's quantized kernels runs on this CPU")
def test_the_default_gives_one_answer_alone_cached_chunked_and_batched():
    """The quantized default, 48 greedy tokens per prompt: each prompt alone on a
    fresh engine; after another request cached the shared system prompt; with
    prefill chunks of 7, 16, 24 and 64 tokens; inside a batch of 8 mixed
    requests. Every run gives the same tokens and the same log-probabilities."""
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=0)

    def answers(llm: LLM, prompts: list[str]) -> list[tuple]:
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [(tuple(o.token_ids), tuple(lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)))
                for o in outs]

    fresh = LLM(max_num_seqs=8, kv_cache_tokens=4096, enable_prefix_caching=False)
    assert fresh.loaded.weight_formats, "the CPU default keeps the GGUF's blocks"
    alone = [answers(fresh, [p])[0] for p in ASKS]
    for chunk in (7, 16, 24, 64):
        chunked = LLM(max_num_seqs=8, kv_cache_tokens=4096, max_num_batched_tokens=chunk)
        for i, p in enumerate(ASKS):   # one at a time: every chunk boundary is this prompt's
            assert answers(chunked, [p])[0] == alone[i], (chunk, p)
        # and again with every prompt's system prompt and the parity prompts cached
        assert answers(chunked, ASKS[::-1]) == alone[::-1], chunk
    batched = LLM(max_num_seqs=8, kv_cache_tokens=4096)
    assert answers(batched, [OTHER, *ASKS]) == [answers(fresh, [OTHER])[0], *alone]


@pytest.mark.parametrize("arch", ["granitemoehybrid_mamba", "qwen3_5"])
def test_a_recurrent_model_gives_one_answer_alone_cached_chunked_and_batched(arch, tmp_path):
    """A hybrid model's Q8_0 GGUF (Mamba-2 or Gated DeltaNet layers beside attention, on the torch
    step over ggml's kernels), 24 greedy tokens per prompt: each alone; with prefill chunks of 5,
    16 and 37 tokens; after the prompts' shared part was cached (the state from its snapshot).
    The recurrent layers compute each block whole from the state at its start
    (model/state_pool.py), so every run gives the same tokens and the same log-probabilities, to
    the bit. Inside one batch: the same tokens, log-probabilities within float32 rounding (torch's
    elementwise kernels may round an element otherwise by where it falls in a vector)."""
    from helpers.gguf_writer import write_gguf
    from helpers.tiny_models import VOCAB, build
    build(arch, tmp_path)
    path = write_gguf(tmp_path, tmp_path / "q8.gguf", "Q8_0")
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(0, VOCAB - 3, (37,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, VOCAB - 3, (n,), generator=gen).tolist() for n in (3, 11, 30)]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True)

    def answers(llm: LLM, batch: list[list[int]]) -> list[tuple]:
        outs = [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]
        return [(tuple(o.token_ids), tuple(lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)))
                for o in outs]

    fresh = LLM(path, enable_prefix_caching=False, max_num_seqs=4, kv_cache_tokens=2048)
    assert fresh.loaded.weight_formats and fresh.engine.recurrent
    alone = [answers(fresh, [p])[0] for p in prompts]
    for chunk in (5, 16, 37):
        chunked = LLM(path, enable_prefix_caching=False, max_num_batched_tokens=chunk, max_num_seqs=4,
                      kv_cache_tokens=2048)
        assert [answers(chunked, [p])[0] for p in prompts] == alone, chunk
    cached = LLM(path, max_num_seqs=4, kv_cache_tokens=2048)
    assert [answers(cached, [p])[0] for p in prompts] == alone
    assert cached.stats()["prefix_cache_hit_tokens"] > 0, "no prompt started from a snapshot"
    batched = answers(LLM(path, max_num_seqs=4, kv_cache_tokens=2048), prompts)
    assert [tokens for tokens, _ in batched] == [tokens for tokens, _ in alone]
    for (_, got), (_, want) in zip(batched, alone):
        assert max(abs(g - w) for g, w in zip(got, want)) < 1e-4
