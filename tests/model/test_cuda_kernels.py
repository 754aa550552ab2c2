"""The CUDA kernels (cuda/): built into the native module wherever nvcc is
found at build time (make test installs it; rust/build.rs),
their algorithms checked on the CPU through the Rust references that run
the same passes (rust/cuda/reference.rs), their launchers' argument checks
run without a GPU, and the kernels themselves checked against the
references and torch where a GPU is (skipped with the reason elsewhere).

On a GPU machine: `make gpu-check` runs this file and benches/bench_cuda.py."""
from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from guided import _native
from guided.model import cuda_ops
from helpers import sampling

ROOT = Path(__file__).resolve().parents[2]
GPU, WHY_NOT = cuda_ops.status()
needs_gpu = pytest.mark.skipif(not (GPU and torch.cuda.is_available()),
                               reason=f"no GPU here: {WHY_NOT or 'torch sees no CUDA device'}")


def test_every_kernel_file_is_built_in():
    built = dict(_native.cuda_kernel_files())
    assert set(built) == {p.stem for p in (ROOT / "cuda").glob("*.cu")}
    assert all(size > 10_000 for size in built.values()), built


# -- decode attention --------------------------------------------------------

def _paged_case(seqs, heads, kv_heads, head, block_size, lens, dtype, seed=0):
    """Random q and caches, each sequence's blocks scattered over the pool."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens) + 1
    num_blocks = seqs * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head, generator=g).to(dtype)
    q = torch.randn(seqs, heads, head, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:seqs * max_blocks].view(seqs, max_blocks).int()
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def _torch_decode(q, k_cache, v_cache, tables, lens, scale, window=0, softcap=0.0, sinks=None):
    """Gather each sequence's positions (the last ``window`` of them) and
    attend in float32: SDPA, or by hand with a soft-cap or sinks."""
    seqs, heads, head = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(seqs, heads, head)
    for s in range(seqs):
        n = int(lens[s])
        if n == 0:
            continue
        pos = torch.arange(max(0, n - window) if window else 0, n)
        rows = tables[s, pos // block_size].long() * block_size + pos % block_size
        keys = k_cache.view(-1, kv_heads, head)[rows].float().repeat_interleave(heads // kv_heads, 1)
        values = v_cache.view(-1, kv_heads, head)[rows].float().repeat_interleave(heads // kv_heads, 1)
        if not softcap and sinks is None:
            out[s] = F.scaled_dot_product_attention(q[s].float()[:, None], keys.transpose(0, 1),
                                                    values.transpose(0, 1), scale=scale)[:, 0]
            continue
        w = torch.einsum("hd,phd->hp", q[s].float(), keys) * scale
        if softcap:
            w = torch.tanh(w / softcap) * softcap
        if sinks is not None:
            w = torch.cat([w, sinks.float()[:, None]], 1).softmax(1)[:, :-1]
        else:
            w = w.softmax(1)
        out[s] = torch.einsum("hp,phd->hd", w, values)
    return out


SHAPES = [  # seqs, heads, kv_heads, head, block_size, context lengths, scores beyond the scale
    (3, 8, 8, 64, 16, [1, 17, 100], {}),
    (2, 8, 2, 128, 16, [33, 5], {}),
    (4, 4, 1, 64, 32, [64, 65, 1, 0], {}),
    (1, 16, 4, 128, 8, [257], {}),
    (3, 8, 2, 128, 16, [50, 8, 3], dict(window=8)),                 # Mistral, gpt-oss: a sliding window
    (2, 4, 2, 64, 16, [40, 0], dict(softcap=20.0)),                 # Gemma 2: soft-capped scores
    (2, 8, 2, 64, 16, [70, 1], dict(sinks=True, window=32)),        # gpt-oss: sinks, sliding
    (2, 4, 1, 256, 16, [300, 7], {}),                               # Gemma 3: head 256
    (2, 8, 4, 256, 16, [129, 2], dict(window=64, softcap=30.0, sinks=True)),
]


def _scores(heads: int, scores: dict, seed: int) -> dict:
    """The case's window, soft-cap and sinks (random logits, some above the scores)."""
    out = dict(scores)
    if out.pop("sinks", False):
        out["sinks"] = torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 3
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_reference_decode_matches_torch(dtype):
    """The kernel's algorithm (partitions with their own online softmax,
    merged) against attention in torch on the gathered positions: GQA,
    head sizes 64, 128 and 256, lengths that are not a multiple of the
    block size, an empty one, sliding windows, soft-caps and sinks; the
    caches in each dtype the kernel takes (read as float32)."""
    for i, (seqs, heads, kv, head, bs, lens, extra) in enumerate(SHAPES):
        q, kc, vc, tables, ctx = _paged_case(seqs, heads, kv, head, bs, lens, dtype, seed=i)
        scale, sc = head ** -0.5, _scores(heads, extra, i)
        sinks = sc.get("sinks")
        got = _native.reference_paged_decode(q.float().numpy(), kc.float().numpy(), vc.float().numpy(),
                                             tables.numpy(), ctx.numpy(), scale, sc.get("window", 0),
                                             sc.get("softcap", 0.0), None if sinks is None else sinks.numpy())
        want = _torch_decode(q, kc, vc, tables, ctx, scale, **sc)
        assert np.abs(got - want.numpy()).max() < 1e-5, (i, np.abs(got - want.numpy()).max())


# -- mask-fused sampling -----------------------------------------------------

def _params(rows, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0):
    return dict(temperature=np.full(rows, temperature, np.float32), top_k=np.full(rows, top_k, np.int32),
                top_p=np.full(rows, top_p, np.float32), min_p=np.full(rows, min_p, np.float32),
                seeds=np.full(rows, seed, np.uint64), steps=np.arange(rows, dtype=np.uint64))


def _pack(allowed: np.ndarray) -> np.ndarray:
    """[rows, vocab] bool → the CPU sampler's int32 words (bit j of word i: token 32 i + j)."""
    rows, vocab = allowed.shape
    padded = np.zeros((rows, -(-vocab // 32) * 32), bool)
    padded[:, :vocab] = allowed
    bits = padded.reshape(rows, -1, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    return bits.sum(-1).astype(np.uint32).view(np.int32)


def _filtered(logits: torch.Tensor, allowed, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """The distribution to draw from, the torch way (vLLM's order): mask,
    temperature, top-k, top-p over what top-k kept (sorted), then min-p."""
    x = logits.masked_fill(~allowed, -math.inf) / temperature
    if top_k:
        kth = torch.topk(x, top_k).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if top_p < 1:
        probs, order = torch.softmax(x, -1).sort(descending=True)
        drop = probs.cumsum(-1) - probs >= top_p  # the mass before a token already reaches p
        x = x.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    probs = torch.softmax(x, -1)
    if min_p:
        probs = probs.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, 0)
    return probs / probs.sum(-1, keepdim=True)


def _chi2_critical(df: int, z: float = 3.72) -> float:
    """Wilson–Hilferty's upper quantile of chi-square (z = 3.72: p = 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_reference_greedy_is_the_masked_argmax():
    rng = np.random.default_rng(0)
    rows, vocab = 64, 1000
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 3
    allowed = rng.random((rows, vocab)) < 0.3
    tokens, logprobs = _native.reference_masked_sample(logits, _pack(allowed), **_params(rows, 0.0))
    masked = torch.from_numpy(logits).masked_fill(~torch.from_numpy(allowed), -math.inf)
    assert (tokens == masked.argmax(-1).numpy()).all()
    want = torch.log_softmax(masked, -1).gather(1, torch.from_numpy(tokens)[:, None])[:, 0]
    assert np.abs(logprobs - want.numpy()).max() < 1e-5
    # nothing allowed: no token
    none = np.zeros((1, vocab), bool)
    assert _native.reference_masked_sample(logits[:1], _pack(none), **_params(1, 0.0))[0][0] == -1


def _gpu_masked_sample(logits, mask, **params):
    tokens, logprobs = cuda_ops.masked_sample(torch.from_numpy(logits).cuda(), torch.from_numpy(mask).cuda(),
                                              **params)
    return tokens.cpu().numpy(), logprobs.cpu().numpy()


#: the sampler's algorithm on the CPU, and the kernel on a GPU (skipped without one)
SAMPLERS = [pytest.param(_native.reference_masked_sample, id="reference"),
            pytest.param(_gpu_masked_sample, id="gpu", marks=needs_gpu)]


@pytest.mark.parametrize("sample", SAMPLERS)
@pytest.mark.parametrize("knobs", [dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                                   dict(temperature=1.3, top_p=0.8), dict(temperature=1.0, min_p=0.1),
                                   dict(temperature=0.9, top_k=12, top_p=0.9, min_p=0.02)],
                         ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_draws_follow_the_filtered_distribution(knobs, sample):
    """40,000 seeded draws of one masked row (each its own step) against
    the distribution torch computes: chi-square at p = 1e-4; masked and
    filtered-out tokens never drawn; each draw's logprob is its token's."""
    rng = np.random.default_rng(1)
    vocab, draws = 80, 40_000
    row = (rng.normal(size=vocab) * 1.5).astype(np.float32)
    allowed = rng.random(vocab) < 0.6
    probs = _filtered(torch.from_numpy(row)[None], torch.from_numpy(allowed)[None],
                      knobs.get("temperature"), knobs.get("top_k", 0), knobs.get("top_p", 1.0),
                      knobs.get("min_p", 0.0))[0].double().numpy()
    params = _params(draws, **knobs, seed=7)
    tokens, logprobs = sample(np.repeat(row[None], draws, 0), np.repeat(_pack(allowed[None]), draws, 0), **params)
    counts = np.bincount(tokens, minlength=vocab)
    assert counts[probs == 0].sum() == 0, "a masked or filtered-out token was drawn"
    support = probs > 0
    expected = probs[support] * draws
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < _chi2_critical(int(support.sum()) - 1), (chi2, int(support.sum()))
    assert np.abs(logprobs - np.log(probs[tokens])).max() < 1e-4
    again = sample(np.repeat(row[None], 100, 0), np.repeat(_pack(allowed[None]), 100, 0),
                   **_params(100, **knobs, seed=7))[0]
    assert (again == tokens[:100]).all(), "a seeded draw did not repeat"


def test_reference_on_a_large_vocabulary():
    """152k tokens (a Qwen vocabulary), a grammar-like mask of a few hundred
    tokens: top-k/top-p cuts land where torch's do."""
    rng = np.random.default_rng(2)
    vocab = 152_064
    row = rng.normal(size=vocab).astype(np.float32) * 4
    allowed = np.zeros(vocab, bool)
    allowed[rng.choice(vocab, 300, replace=False)] = True
    for knobs in (dict(top_k=20), dict(top_p=0.5)):
        probs = _filtered(torch.from_numpy(row)[None], torch.from_numpy(allowed)[None], 1.0,
                          knobs.get("top_k", 0), knobs.get("top_p", 1.0), 0.0)[0].numpy()
        tokens, _ = _native.reference_masked_sample(np.repeat(row[None], 2000, 0),
                                                    np.repeat(_pack(allowed[None]), 2000, 0),
                                                    **_params(2000, **knobs, seed=3))
        assert set(tokens.tolist()) <= set(np.flatnonzero(probs > 0).tolist())
        assert len(set(tokens.tolist())) > 1


# -- the launchers' checks, on any machine ------------------------------------

def _fake(shape, dtype="torch.float32", device="cuda:0", contiguous=True):
    """A tensor as the launchers see it, for a device this machine may not have."""
    return (0, list(shape), dtype, device, contiguous)


def test_launchers_refuse_bad_calls_before_launching():
    q, kc = _fake([2, 8, 64]), _fake([10, 16, 2, 64])
    tables, lens = _fake([2, 4], "torch.int32"), _fake([2], "torch.int32")
    cases = [
        ((_fake([2, 8, 64], device="cpu"), kc, kc, tables, lens, q), "q: must be on a CUDA device"),
        ((q, _fake([10, 16, 2, 64], "torch.float16"), kc, tables, lens, q), "k_cache: must be torch.float32"),
        ((q, kc, kc, _fake([3, 4], "torch.int32"), lens, q), "block_tables: has shape [3, 4]"),
        ((q, kc, kc, tables, _fake([2], "torch.int64"), q), "context_lens: must be torch.int32"),
        ((q, kc, kc, tables, lens, _fake([2, 8, 64], device="cuda:1")), "out: is on cuda:1"),
        ((q, kc, kc, tables, lens, _fake([2, 8, 64], contiguous=False)), "out: must be contiguous"),
        ((_fake([2, 7, 64]), kc, kc, tables, lens, _fake([2, 7, 64])), "multiple of kv_heads"),
        ((_fake([2, 8, 80]), _fake([10, 16, 2, 80]), _fake([10, 16, 2, 80]), tables, lens,
          _fake([2, 8, 80])), "head size 80"),
        ((_fake([2, 8, 64], "torch.int8"), _fake([10, 16, 2, 64], "torch.int8"),
          _fake([10, 16, 2, 64], "torch.int8"), tables, lens, _fake([2, 8, 64], "torch.int8")), "torch.int8"),
    ]
    for args, needle in cases:
        with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            _native.cuda_paged_decode(*args, 0.125, 0, 0.0, None, 0)
    with pytest.raises(ValueError, match=r"sinks: has shape \[4\]"):
        _native.cuda_paged_decode(q, kc, kc, tables, lens, q, 0.125, 0, 0.0, _fake([4]), 0)
    with pytest.raises(ValueError, match="sinks: must be torch.float32"):
        _native.cuda_paged_decode(q, kc, kc, tables, lens, q, 0.125, 0, 0.0, _fake([8], "torch.bfloat16"), 0)
    with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
        _native.cuda_paged_decode(q, kc, kc, tables, lens, q, 0.125, 0, -1.0, None, 0)
    rows = [_fake([4], t) for t in ("torch.float32", "torch.int32", "torch.float32", "torch.float32",
                                     "torch.int64", "torch.int64", "torch.int64", "torch.float32")]
    with pytest.raises(ValueError, match="mask: 3 words per row; 100 tokens need 4"):
        _native.cuda_masked_sample(_fake([4, 100]), _fake([4, 3], "torch.int32"), *rows, 0)
    with pytest.raises(ValueError, match="logits: must be torch.float32"):
        _native.cuda_masked_sample(_fake([4, 100], "torch.float16"), None, *rows, 0)
    with pytest.raises(ValueError, match="top_k: has shape"):
        _native.cuda_masked_sample(_fake([4, 100]), None, rows[0], _fake([5], "torch.int32"), *rows[2:], 0)
    with pytest.raises(ValueError, match="row 1: top_p must be in"):
        _native.check_sample_params(100, None, np.ones(2, np.float32), np.zeros(2, np.int32),
                                    np.array([1.0, 0.0], np.float32), np.zeros(2, np.float32))
    # torch tensors off the GPU, through the Python layer
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        cuda_ops.masked_sample(torch.zeros(2, 100), None, [1, 1], [0, 0], [1, 1], [0, 0], [0, 0], [0, 0])
    entry = _fake([3], "torch.int32")
    with pytest.raises(ValueError, match="bias: must be torch.float32"):
        _native.cuda_adjust_logits(_fake([4, 100]), entry, entry, entry, entry, entry,
                                   *[_fake([4])] * 3, 0)
    with pytest.raises(ValueError, match="presence: has shape"):
        _native.cuda_adjust_logits(_fake([4, 100]), entry, entry, entry, entry, _fake([3]),
                                   _fake([4]), _fake([4]), _fake([5]), 0)
    with pytest.raises(ValueError, match="slots: must be torch.int64"):
        _native.cuda_write_kv(_fake([3, 2, 64]), _fake([3, 2, 64]), kc, kc, _fake([3], "torch.int32"), 0)
    if not GPU:
        # a call that passes every check gets the reason the kernels cannot run here
        with pytest.raises(RuntimeError, match=WHY_NOT.split(" (")[0]):
            _native.cuda_paged_decode(q, kc, kc, tables, lens, q, 0.125, 0, 0.0, None, 0)


# -- on a GPU -----------------------------------------------------------------

@needs_gpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-3), (torch.float16, 2e-2),
                                              (torch.bfloat16, 2e-2)], ids=str)
def test_gpu_decode_matches_torch(dtype, tolerance):
    for i, (seqs, heads, kv, head, bs, lens, extra) in enumerate(SHAPES):
        q, kc, vc, tables, ctx = _paged_case(seqs, heads, kv, head, bs, lens, dtype, seed=i)
        scale, sc = head ** -0.5, _scores(heads, extra, i)
        on_gpu = {**sc, "sinks": sc["sinks"].cuda()} if "sinks" in sc else sc
        got = cuda_ops.paged_decode(q.cuda(), kc.cuda(), vc.cuda(), tables.cuda(), ctx.cuda(), scale, **on_gpu)
        want = _torch_decode(q, kc, vc, tables, ctx, scale, **sc)
        assert (got.float().cpu() - want).abs().max() < tolerance, i


@needs_gpu
def test_gpu_write_kv_matches_index_copy():
    kc = torch.zeros(6, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    k, v = torch.randn(5, 2, 64, device="cuda").bfloat16(), torch.randn(5, 2, 64, device="cuda").bfloat16()
    slots = torch.tensor([3, 17, 40, -1, 95], device="cuda")
    cuda_ops.write_kv(k, v, kc, vc, slots)
    keep = slots >= 0
    assert torch.equal(kc.view(-1, 2, 64)[slots[keep]], k[keep])
    assert torch.equal(vc.view(-1, 2, 64)[slots[keep]], v[keep])


@needs_gpu
def test_gpu_sampling_matches_the_reference():
    """Greedy is the masked argmax exactly; seeded draws are the
    reference's (same random numbers) and repeat."""
    rng = np.random.default_rng(5)
    rows, vocab = 256, 152_064
    logits = (rng.normal(size=(rows, vocab)) * 3).astype(np.float32)
    mask = _pack(rng.random((rows, vocab)) < 0.01)
    for knobs in (dict(temperature=0.0), dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.01)):
        params = _params(rows, **knobs, seed=11)
        want, want_lp = _native.reference_masked_sample(logits, mask, **params)
        got, got_lp = cuda_ops.masked_sample(torch.from_numpy(logits).cuda(), torch.from_numpy(mask).cuda(),
                                             **params)
        assert (got.cpu().numpy() == want).mean() > 0.99, knobs  # exp/log last-bit ties aside
        assert np.abs(got_lp.cpu().numpy() - want_lp).max() < 1e-3
        again, _ = cuda_ops.masked_sample(torch.from_numpy(logits).cuda(), torch.from_numpy(mask).cuda(),
                                          **params)
        assert torch.equal(again, got)


@needs_gpu
def test_gpu_adjust_logits_is_the_cpu_samplers_order():
    """Repetition penalty (HF), then frequency and presence on output
    counts, then bias (-inf bans), for the named tokens only."""
    logits = torch.randn(2, 50, device="cuda")
    before = logits.cpu().clone()
    rows, tokens, seen, counts, bias = [0, 0, 1, 1], [3, 7, 3, 9], [1, 1, 1, 0], [2, 0, 1, 0], \
        [0.0, 0.5, 0.0, float("-inf")]
    cuda_ops.adjust_logits(logits, rows, tokens, seen, counts, bias, [1.3, 1.0], [0.2, 0.1], [0.5, 0.0])
    want = before.clone()
    for r, t, s, c, b in zip(rows, tokens, seen, counts, bias):
        v = before[r, t].item()
        if s:
            rp = [1.3, 1.0][r]
            v = v / rp if v > 0 else v * rp
        if c:
            v -= [0.2, 0.1][r] * c + [0.5, 0.0][r]
        want[r, t] = v + b
    assert torch.allclose(logits.cpu(), want)  # equal infinities count as close


@needs_gpu
def test_gpu_default_model_greedy_equals_the_cpu_path(llm):
    """The whole model on the GPU in float32 (decode attention and the KV
    write in our kernels): 64 greedy tokens equal the CPU path's; so does a
    JSON-constrained answer, whose forced tokens make mixed steps (their
    short rows through the decode kernel, a query row per token)."""
    from guided import LLM, SamplingParams
    prompts = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
               "Once upon a time, in a small village by the sea,",
               "<|im_start|>user\nName a large city and its population.<|im_end|>\n<|im_start|>assistant\n"]
    free = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    params = [free, free, SamplingParams(temperature=0, max_tokens=64, structured_outputs={"json": sampling.SCHEMA})]
    gpu = LLM(dtype="float32", device="cuda", max_num_seqs=8, kv_cache_tokens=4096)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, params)]
    assert got == want
    assert gpu.stats()["forced_tokens"] > 0


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="tensor parallelism over NCCL needs two GPUs")
def test_two_gpus_over_nccl_give_the_cpu_paths_greedy_tokens(llm):
    """Tensor parallelism on NCCL (rank 1 on cuda:1): TP=2 in float32 gives
    the CPU path's greedy tokens (the gloo test is tests/model/test_tensor_parallel.py)."""
    from guided import LLM, SamplingParams
    prompts = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
               "Once upon a time, in a small village by the sea,"]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    split = LLM(dtype="float32", device="cuda", max_num_seqs=8, kv_cache_tokens=4096,
                tensor_parallel_size=2)
    try:
        assert split.loaded.tensor_group.backend == "nccl"
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        got = [o.outputs[0].token_ids for o in split.generate(prompts, params)]
        assert got == want
    finally:
        split.close()


@needs_gpu
def test_gpu_engine_samples_on_the_device_as_the_host_would(llm):
    """The engine step on the GPU samples with the kernels (only tokens come
    back): the sampling helper's batch (greedy, seeded, top-k/p, min-p,
    penalties, bias, min_tokens bans, JSON and choice masks, a top-logprobs
    row on the host) gives the host sampler's tokens over the same logits.
    Greedy rows are exact; a seeded row may part at a last-bit tie of exp/log
    between the GPU and the CPU, so those must agree on their first token
    and nearly all rows must agree throughout."""
    from guided import LLM
    gpu = LLM(dtype="float32", device="cuda", max_num_seqs=16, kv_cache_tokens=8192)
    assert gpu.engine.runner.sampler is not None, "the runner did not choose device sampling"
    device = sampling.run(gpu, gpu.engine.runner.sampler)
    host = sampling.run(gpu, None)
    greedy = [i for i, p in enumerate(sampling.requests()[1]) if p.temperature == 0]
    for i in greedy:
        assert device[i].token_ids == host[i].token_ids, i
    assert all(d.token_ids[:1] == h.token_ids[:1] for d, h in zip(device, host))
    same = sum(d.token_ids == h.token_ids for d, h in zip(device, host))
    assert same >= len(host) - 1, [(d.text, h.text) for d, h in zip(device, host)]
    jsonschema.validate(json.loads(device[7].text), sampling.SCHEMA)
