"""The CPU step as native code (rust/cpu/native_step.rs, model/native.py) against the
torch decoder it replaces on the CPU (decoder.py, still the CUDA path).

Every architecture's tiny model (helpers/tiny_models.py), through the engine,
both ways:

- float32 weights (the safetensors checkpoint): the same greedy tokens and
  top-5 log-probabilities within 1e-4, with the native side's prompts
  prefilled in chunks of 16 and decoded in one batch;
- the same checkpoint as a Q8_0 GGUF, in its blocks (the CPU default): the
  packed kernels quantize each activation row to 8 bits in both steps, but
  torch's norms and ours part in the last bit, which now and then moves one
  activation across a rounding step. On these 64-wide models one such step
  moves a log-probability by up to ~0.13 (Gemma 3, whose embeddings are
  scaled by 8), under what the 8-bit activations themselves move it from
  float32's (0.28 there). So: log-probabilities within 0.15, and the same greedy
  tokens until the reference comes within 0.3 of a tie; a wrong layer part
  moves them by whole units.

Then what the native step promises on its own: one request, one answer — a
prompt alone, chunked, batched with others and after a prefix-cache hit gives
the same tokens and log-probabilities to the bit (sliding windows, soft-caps,
sinks, experts and short convolutions included); a clear refusal where it cannot run.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guided import LLM, SamplingParams, _native
from helpers.gguf_writer import write_gguf
from helpers.tiny_models import ARCHITECTURES, VOCAB, build

pytestmark = pytest.mark.skipif(_native.quant_kernels() is None,
                                reason="the native step needs this CPU's build of the kernels (AVX2)")

#: llama.cpp's converter drops Mistral's sliding window; no deepseek2, nemotron_h or qwen3next file here, and
#: Falcon-H1's and Qwen3-Next's files are checked in test_architectures (test_architectures.NO_GGUF);
#: Qwen3.5's Q8_0 blocks on the torch step differ from their float32 dequantization by up to 0.3 in
#: log-probability on its tiny random row (0.03-0.08 for Granite 4.0-H's or Qwen3's: its gated
#: attention and DeltaNet amplify the 8-bit activations), past the 0.15 below;
#: test_architectures checks its files against transformers and test_hybrid_models runs one
NO_GGUF = {"mistral_swa", "glm4_moe_lite", "qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h", "nemotron_h_moe", "falcon_h1",
           "falcon_h1_norm"}
#: what the native step refuses by name (the torch step runs them)
NOT_NATIVE = {"deepseek_v3": "latent attention", "glm4_moe_lite": "latent attention",
              "granitemoehybrid_mamba": "recurrent layers", "granitemoehybrid_moe": "recurrent layers",
              "qwen3_5": "recurrent layers", "qwen3_5_moe": "recurrent layers", "qwen3_next": "recurrent layers",
              "nemotron_h": "recurrent layers", "nemotron_h_moe": "recurrent layers", "falcon_h1": "recurrent layers", "falcon_h1_norm": "recurrent layers"}
GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch → (safetensors directory, Q8_0 GGUF or None, prompts), built once."""
    made: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in made:
            directory = tmp_path_factory.mktemp(arch)
            build(arch, directory)
            q8 = None if arch in NO_GGUF else write_gguf(directory, directory / "q8_0.gguf", "Q8_0")
            gen = torch.Generator().manual_seed(3)
            # Phi-3's LongRoPE switches at 32 tokens in transformers; any lengths do here
            prompts = [torch.randint(0, VOCAB - 3, (n,), generator=gen).tolist() for n in (5, 23, 70)]
            made[arch] = (str(directory), q8, prompts)
        return made[arch]
    return get


def _outputs(path: str, step: str, prompts, dtype=None, **engine):
    llm = LLM(path, dtype=dtype, cpu_step=step, enable_prefix_caching=False, **engine)
    assert (llm.engine.runner.native is not None) == (step == "native")
    return [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _compare(ref, ours, logprob_tol: float, tie: float) -> None:
    """Greedy tokens equal while the reference's top two are more than `tie` apart;
    every log-probability both list within `logprob_tol` up to there."""
    for a, b in zip(ref, ours):
        for i, (t, lp_a, lp_b) in enumerate(zip(a.token_ids, a.logprobs, b.logprobs)):
            common = set(lp_a) & set(lp_b)
            worst = max(abs(lp_a[k].logprob - lp_b[k].logprob) for k in common)
            assert worst < logprob_tol, (i, worst)
            top = sorted((v.logprob for v in lp_a.values()), reverse=True)
            if top[0] - top[1] < tie:
                break
            assert b.token_ids[i] == t, (i, a.token_ids, b.token_ids)


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a not in NOT_NATIVE])
def test_every_architecture_runs_natively_as_torch_runs_it(arch, checkpoints):
    directory, q8, prompts = checkpoints(arch)
    ref = _outputs(directory, "torch", prompts, dtype="float32")
    ours = _outputs(directory, "native", prompts, dtype="float32", max_num_batched_tokens=16)
    _compare(ref, ours, 1e-4, 1e-3)
    if q8 is not None:
        ref = _outputs(q8, "torch", prompts)
        ours = _outputs(q8, "native", prompts, max_num_batched_tokens=16)
        assert LLM(q8, cpu_step="auto").engine.runner.native is not None, "a GGUF in blocks runs natively by default"
        _compare(ref, ours, 0.15, 0.3)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text", "gpt_oss", "glm4_moe", "lfm2"])
def test_one_request_one_answer_on_the_native_step(arch, checkpoints):
    """Sliding windows and soft-caps (Gemma), sinks and experts (gpt-oss), grouped
    sigmoid routing with a shared expert (GLM), short convolutions reading the
    tokens before a chunk (LFM2): each prompt alone, chunked by 7, in a batch,
    and again after its prefix is cached gives the same bits."""
    _, q8, prompts = checkpoints(arch)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True)

    def answers(llm, ps):
        outs = [o.outputs[0] for o in llm.generate(ps, params, use_tqdm=False)]
        return [(o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]

    alone = LLM(q8, cpu_step="native", enable_prefix_caching=False)
    want = [answers(alone, [p])[0] for p in prompts]
    chunked = LLM(q8, cpu_step="native", max_num_batched_tokens=7)
    assert [answers(chunked, [p])[0] for p in prompts] == want
    assert answers(chunked, prompts[::-1]) == want[::-1]   # prefixes now cached
    assert chunked.stats()["prefix_cache_hit_tokens"] > 0
    batched = LLM(q8, cpu_step="native")
    assert answers(batched, prompts + [p[:3] + p for p in prompts]) [:3] == want


@pytest.fixture(scope="module")
def alone_engines(checkpoints):
    """arch → an engine that runs each prompt by itself (no prefix cache)."""
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = LLM(checkpoints(arch)[1], cpu_step="native", enable_prefix_caching=False)
        return made[arch]
    return get


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arch=st.sampled_from(["gemma3_text", "gpt_oss", "lfm2"]),
       lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5), chunk=st.integers(2, 48),
       repeat_first=st.booleans(), seed=st.integers(0, 2**16))
def test_generated_batches_and_chunks_change_no_answer(arch, lengths, chunk, repeat_first, seed, alone_engines):
    """Generated prompt sets (lengths 1-40, some sharing a prefix) and prefill chunk sizes:
    every prompt's tokens and log-probabilities in the batch are its own alone, to the bit."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB - 3, (n,), generator=gen).tolist() for n in lengths]
    if repeat_first:   # a prefix another prompt shares, for the cache to hit
        prompts.append(prompts[0] + prompts[-1])
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)

    def answers(llm, ps):
        return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in llm.generate(ps, params, use_tqdm=False)]

    alone = [answers(alone_engines(arch), [p])[0] for p in prompts]
    together = LLM(alone_engines(arch).loaded.path, cpu_step="native", max_num_batched_tokens=chunk)
    assert answers(together, prompts) == alone


@pytest.mark.parametrize("arch", list(NOT_NATIVE))
def test_what_the_native_step_cannot_run_is_refused_by_name_and_runs_in_torch(arch, checkpoints):
    from guided.model.native import NotNative
    directory, q8, prompts = checkpoints(arch)
    with pytest.raises(NotNative, match=NOT_NATIVE[arch]):
        LLM(directory, dtype="float32", cpu_step="native")
    llm = LLM(directory, dtype="float32", cpu_step="auto")
    assert llm.engine.runner.native is None and llm.generate(prompts, GREEDY, use_tqdm=False)
    if q8 is not None:   # a GGUF in its blocks: the torch step over the blocks, as its float32 load
        blocks = LLM(q8, cpu_step="auto", enable_prefix_caching=False)
        assert blocks.engine.runner.native is None and "Q8_0" in blocks.loaded.weight_formats
        _compare(_outputs(q8, "torch", prompts, dtype="float32"), _outputs(q8, "torch", prompts), 0.15, 0.3)


def test_where_the_native_step_cannot_run_it_says_why(checkpoints):
    directory, _, _ = checkpoints("llama")
    with pytest.raises(ValueError, match="cpu_step='fast'"):
        LLM(directory, dtype="float32", cpu_step="fast")
    with pytest.raises(ValueError, match="bfloat16"):
        LLM(directory, dtype="bfloat16", cpu_step="native")
    # float32 weights keep torch's GEMMs unless asked
    assert LLM(directory, dtype="float32").engine.runner.native is None
