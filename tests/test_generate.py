"""LLM.generate on the default model: parity, batching, prefix cache,
preemption and bad input — what a user of the offline API would notice."""
from __future__ import annotations

import pytest
import torch

from guided import LLM, ModelNotFoundError, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nName three colours of the rainbow.<|im_end|>\n<|im_start|>assistant\n",
]

# Sixteen different prompts of different lengths, so a batch mixes them.
BATCH_PROMPTS = [
    f"Question {i}: what is {i} plus {i * 3}? " + "Think carefully. " * (i % 5) + "Answer:"
    for i in range(16)
]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def greedy_64(llm) -> dict[str, list[int]]:
    """Our greedy tokens for each of PROMPTS, generated in one batch (a
    request's tokens do not depend on its batch: see the tests below)."""
    outs = llm.generate([llm.tokenizer.encode(p) for p in PROMPTS], greedy(64))
    return {p: o.token_ids for p, o in zip(PROMPTS, outs)}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_match_transformers(llm, hf_default, greedy_64, prompt):
    model = hf_default
    ids = llm.tokenizer.encode(prompt)
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert greedy_64[prompt] == ref


@pytest.fixture(scope="module")
def batch_of_16(llm):
    """BATCH_PROMPTS generated together, greedy, 48 tokens each."""
    return llm.generate(BATCH_PROMPTS, greedy(48))


def test_batch_of_16_matches_each_alone(llm, batch_of_16):
    for prompt, out in zip(BATCH_PROMPTS, batch_of_16):
        alone = llm.generate([prompt], greedy(24))[0]
        # greedy: the first 24 tokens do not depend on max_tokens
        assert out.token_ids[:24] == alone.token_ids, prompt


def test_prefix_cache_hit_and_same_output(llm):
    shared = " ".join(f"item{i}" for i in range(120))  # well over 200 tokens
    cached = llm
    uncached = LLM(dtype="float32", max_num_seqs=4, kv_cache_tokens=4096,
                   enable_prefix_caching=False)
    prefix_ids = cached.tokenizer.encode(shared)[:200]
    first = prefix_ids + cached.tokenizer.encode(" first", parse_special=False)
    second = prefix_ids + cached.tokenizer.encode(" second ending", parse_special=False)
    cached.generate([first], greedy(8))
    hit = cached.generate([second], greedy(16))[0]
    miss = uncached.generate([second], greedy(16))[0]
    assert hit.num_cached_tokens >= 192
    assert miss.num_cached_tokens == 0
    assert hit.token_ids == miss.token_ids
    assert cached.stats()["prefix_cache_hit_tokens"] >= 192


def test_preemption_finishes_everything_with_same_output(batch_of_16):
    # 16 requests of ~40 prompt + 48 new tokens need ~16*6 blocks; give 24.
    small = LLM(dtype="float32", max_num_seqs=16, kv_cache_tokens=24 * 16)
    tight = small.generate(BATCH_PROMPTS, greedy(48))
    ample = batch_of_16
    assert small.stats()["preemptions"] > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in ample]
    assert all(o.finish_reason == "length" for o in tight)


def test_sampling_is_seeded(llm):
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    a, b, c = llm.generate(["Once upon a time"] * 3, [
        params, params, SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=8)])
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_string_cuts_text(llm):
    out, stopped = llm.generate(["1, 2, 3, 4, 5, 6,"] * 2,
                                [greedy(20), SamplingParams(max_tokens=20, stop=[" 8"])])
    assert "8" in out.text
    assert stopped.finish_reason == "stop"
    assert stopped.text == out.text[:out.text.index(" 8")]


def test_stop_token_ids_and_end_tokens(llm):
    chat = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    out = llm.generate([chat], SamplingParams(max_tokens=200))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.engine.special.end_ids
    assert "<|im_end|>" not in out.text
    first = out.token_ids[0]
    cut = llm.generate([chat], SamplingParams(max_tokens=200, stop_token_ids=[first]))[0]
    assert cut.token_ids == [first] and cut.finish_reason == "stop" and cut.text == ""


def test_max_tokens_gives_length(llm):
    out = llm.generate(["The capital of France is"], greedy(5))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_bad_input_raises_and_engine_keeps_working(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""])
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate(["fine", [1] * (llm.engine.max_model_len + 5)])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ModelNotFoundError, match="no/such/model.gguf"):
        LLM("/no/such/model.gguf")
    assert not llm.engine.has_unfinished()
    out = llm.generate(["The capital of France is"], greedy(4))[0]
    assert len(out.token_ids) == 4


def test_chat_renders_template_and_stops(llm):
    reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(max_tokens=64))[0].outputs[0]
    assert reply.finish_reason == "stop"
    assert "Paris" in reply.content
