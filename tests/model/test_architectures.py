"""Every architecture guided loads, against transformers (issue 37).

For each row of helpers/tiny_models.ARCHITECTURES, a tiny random model built
from transformers' own config class, saved as a Hub-layout safetensors
directory and written as GGUF the way llama.cpp's converter writes it (F32
and Q8_0, helpers/gguf_writer.py). transformers' forward is the reference:

- float32 logits within 1e-4 (relative to the logits' scale) on prompts of
  5, 23 and 70 tokens (windows are 8 wide, so the prompts cross them);
- 32 greedy tokens equal to transformers' `generate`, with prefill in chunks
  of 16, and in a batch of mixed lengths whose decode steps are shared;
- through the engine: a second request that hits the prefix cache answers
  as the first did;
- a Q8_0 GGUF against transformers running the same weights rounded through
  Q8_0 (the blocks lie along each row, so rounding the checkpoint's tensors
  equals the GGUF's);
- gpt-oss's parts: MXFP4 blocks against known values and transformers'
  dequantization; the Hub's MXFP4 `*_blocks`/`*_scales` experts and a GGUF
  with MXFP4 experts against transformers with its experts rounded alike;
  YaRN's frequencies against transformers' (truncated or not, as gpt-oss's
  config says); the clamped SwiGLU past its limit;
- tensor parallelism over two ranks equal to one (a sliding-window,
  soft-capped architecture and two mixtures of experts; the dense case is
  tests/model/test_tensor_parallel.py), and a clear refusal where an
  architecture cannot be split.

Then the real Gemma 3 270M (Q4_K_M from PyPI): its greedy tokens equal
transformers' on the same GGUF, and a json_schema request returns valid JSON
offline and over HTTP.
"""
from __future__ import annotations

import copy
import json
import math
import os
import shutil

import pytest
import torch

from guided import LLM, SamplingParams, _native
from guided.model import load_model
from guided.sampling_params import StructuredOutputsParams
from helpers.gguf_writer import write_gguf
from helpers.live_server import post, running_server
from helpers.paged import PagedRunner, hf_greedy, last_logits
from helpers.tiny_models import ARCHITECTURES, VOCAB, build

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

ARCHS = list(ARCHITECTURES)
#: llama.cpp's converter writes no sliding window for MistralForCausalLM (it goes through its
#: LlamaModel), so that GGUF attends to everything, as llama.cpp itself does
NO_GGUF = {"mistral_swa": "llama.cpp's converter drops Mistral's sliding_window",
           # llama.cpp's deepseek2 files split kv_b_proj into per-head k_b/v_b tensors the loader does not read yet
           "glm4_moe_lite": "llama.cpp converts Glm4MoeLite as deepseek2 with GLM specifics not written here",
           "nemotron_h": "no reader yet for llama.cpp's nemotron_h tensors",
           "nemotron_h_moe": "no reader yet for llama.cpp's nemotron_h_moe tensors",
           # llama.cpp's Mamba-2 graph takes the norm after the gate; this row's config puts it before
           # (mamba_norm_before_gate), and its converter scales biases with the inputs' multipliers
           "falcon_h1_norm": "llama.cpp's falcon-h1 normalises after the gate"}


def _prompt_lengths(arch: str) -> tuple[int, ...]:
    # Phi-3's LongRoPE: a model made for more than its original context (32 here) uses the long
    # factors at every position, as llama.cpp does; transformers switches by the sequence's
    # length, so the two agree on sequences past 32 tokens
    return (33, 50, 70) if arch == "phi3" else (5, 23, 70)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """arch → (its safetensors directory, the transformers model, prompts, their greedy tokens)."""
    made: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in made:
            directory = tmp_path_factory.mktemp(arch)
            hf = build(arch, directory)
            gen = torch.Generator().manual_seed(1)
            prompts = [torch.randint(0, VOCAB - 3, (n,), generator=gen).tolist() for n in _prompt_lengths(arch)]
            made[arch] = (str(directory), hf, prompts, [hf_greedy(hf, p, 32) for p in prompts])
        return made[arch]
    return get


def _assert_matches(loaded, hf, prompts, greedy, arch: str) -> None:
    for ids in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        ours = last_logits(loaded.model, loaded.config, ids)
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4, (arch, len(ids))
    for ids, want in zip(prompts, greedy):
        assert PagedRunner(loaded.model, loaded.config).greedy(ids, 32, chunk=16) == want, (arch, len(ids))
    assert PagedRunner(loaded.model, loaded.config).greedy_together(prompts, 32) == greedy, arch


@pytest.mark.parametrize("arch", ARCHS)
def test_safetensors_match_transformers(arch, tiny):
    directory, hf, prompts, greedy = tiny(arch)
    loaded = load_model(directory, dtype=torch.float32)
    _assert_matches(loaded, hf, prompts, greedy, arch)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in NO_GGUF])
def test_gguf_matches_transformers(arch, qtype, tiny, tmp_path):
    directory, hf, prompts, greedy = tiny(arch)
    path = write_gguf(directory, tmp_path / f"{arch}-{qtype}.gguf", qtype)
    loaded = load_model(path, dtype=torch.float32)
    if qtype == "Q8_0":
        hf = _rounded_through_q8_0(hf)
        greedy = [hf_greedy(hf, p, 32) for p in prompts]
    _assert_matches(loaded, hf, prompts, greedy, arch)


#: transformers parameters held [.., in, out] (gpt-oss's experts, not Qwen3-MoE's or GLM's of the
#: same names): GGUF rows run along their dim -2
_TRANSPOSED = ("experts.gate_up_proj", "experts.down_proj")
_TRANSPOSED_IN = {"gpt_oss"}


def _rounded_through(hf, qtype: gguf.GGMLQuantizationType, names=None):
    """A copy of `hf` whose matrices went through `qtype` and back along the GGUF's rows,
    as the writer stores them (norms, biases, routers and other vectors stay float32);
    `names`: only the parameters whose names end so."""
    rounded = copy.deepcopy(hf)
    transposed = hf.config.model_type in _TRANSPOSED_IN
    folded = _falcon_h1_factors(hf.config) if hf.config.model_type == "falcon_h1" and names is None else None
    c = hf.config

    def round_rows(rows: torch.Tensor) -> None:
        q = gguf.quants.quantize(rows.contiguous().numpy(), qtype)
        rows.copy_(torch.from_numpy(gguf.quants.dequantize(q, qtype)))
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if name.endswith("kv_b_proj.weight") and names is None:
                # DeepSeek's kv_b as the GGUF holds it: k_b's rows along each head's nope part, v_b's
                # along the latent
                kv = p.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
                round_rows(kv[:, :c.qk_nope_head_dim].transpose(1, 2))
                round_rows(kv[:, c.qk_nope_head_dim:])
                continue
            if name.endswith("linear_attn.out_proj.weight") and names is None and c.model_type.startswith("qwen3_5") \
                    and c.linear_num_value_heads != c.linear_num_key_heads:
                # Qwen3.5's DeltaNet output as llama.cpp's qwen35 holds it: its columns (value heads)
                # tiled, then rounded along the rows
                k, share = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads
                tiled = p.view(p.shape[0], k, share, -1).transpose(1, 2).contiguous()
                round_rows(tiled.view(p.shape[0], -1))
                p.copy_(tiled.transpose(1, 2).reshape(p.shape))
                continue
            if folded and (factor := folded(name, p)) is not None:
                # Falcon-H1's multipliers, which llama.cpp's converter folds in before it rounds
                scaled = p * factor
                round_rows(scaled)
                p.copy_(scaled / factor)
                continue
            rows = p.transpose(-1, -2) if transposed and name.endswith(_TRANSPOSED) else p
            if p.dim() < 2 or rows.shape[-1] % 32 or name.endswith(("mlp.gate.weight", "router.weight", "_bias",
                                                                    "shared_expert_gate.weight")):
                continue
            if names is not None and not name.endswith(names):
                continue
            round_rows(rows)
    return rounded


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "gpt_oss", "granitemoehybrid_moe"])
def test_gguf_experts_stay_in_their_blocks_with_dtype_gguf(arch, tiny, tmp_path):
    """dtype="gguf": each expert multiplies through ggml's kernels on its own
    Q8_0 blocks (8-bit activations, as llama.cpp), close to the float32 load of
    the same file."""
    from guided.model.quant_linear import QuantLinear
    directory, _, prompts, _ = tiny(arch)
    path = write_gguf(directory, tmp_path / f"{arch}.gguf", "Q8_0")
    dense, blocks = load_model(path, dtype=torch.float32), load_model(path, dtype="gguf")
    moes = [layer.moe for layer in blocks.model.layers if layer.moe is not None]
    assert moes and all(isinstance(q, QuantLinear) and q.formats == {"Q8_0"}
                        for moe in moes for q in [*moe.gate_up_q, *moe.down_q])
    for ids in prompts:
        want = last_logits(dense.model, dense.config, ids)
        got = last_logits(blocks.model, blocks.config, ids)
        assert ((got - want).abs().max() / want.abs().max()).item() < 5e-2, (arch, len(ids))


def _falcon_h1_factors(config):
    """A function of a Falcon-H1 parameter's name and tensor: the factor llama.cpp's converter
    multiplies it by (its µP multipliers, as guided's reader folds them), or None."""
    from guided.model.hf_loader import scaled
    from guided.model.hybrid_readers import falcon_h1_hf
    cfg = config.to_dict()
    scales = falcon_h1_hf(cfg, {})["weight_scales"]
    ours = {"mamba.in_proj": "mamba_in_proj", "mamba.out_proj": "mamba_out_proj"}

    def factor(name: str, p: torch.Tensor):
        if name.endswith("embed_tokens.weight"):
            return torch.full_like(p, cfg["embedding_multiplier"])
        if name == "lm_head.weight":
            return torch.full_like(p, cfg["lm_head_multiplier"])
        parts = name.split(".")
        module = ours.get(".".join(parts[-3:-1]), parts[-2])
        if module not in scales or not name.endswith(".weight"):
            return None
        return scaled(torch.ones_like(p), *scales[module])
    return factor


def _rounded_through_q8_0(hf):
    return _rounded_through(hf, gguf.GGMLQuantizationType.Q8_0)


# ---------------------------------------------------------------- gpt-oss's parts

def _hub_mxfp4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[.., out, in] floats as a Hub checkpoint stores gpt-oss's experts: `_blocks` [.., out, in/32, 16]
    (two E2M1 codes a byte, the first in the low nibble) and `_scales` [.., out, in/32] (E8M0), the
    values those of gguf's MXFP4 quantizer, whose blocks (scale byte, then byte j holding codes j
    and j + 16) are repacked code by code."""
    q = gguf.quants.quantize(rows.contiguous().numpy(), gguf.GGMLQuantizationType.MXFP4)
    q = torch.from_numpy(q.reshape(*rows.shape[:-1], rows.shape[-1] // 32, 17))
    qs = q[..., 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)           # element order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), q[..., 0].contiguous()


def test_mxfp4_blocks_dequantize_to_their_values():
    from guided.model.mxfp4 import dequantize_mxfp4
    # E2M1 by code: 0, 0.5, 1, 1.5, 2, 3, 4, 6, then the same negated (sign bit 3)
    value = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    codes = list(range(16)) + [1, 9, 7, 15, 0, 8, 3, 11, 2, 10, 4, 12, 5, 13, 6, 14]
    block = [codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)]
    scales = [127, 130, 118, 255]    # ×1, ×8, ×2^-9, NaN
    blocks = torch.tensor([[block] * 4], dtype=torch.uint8)                      # [1, 4, 16]
    out = dequantize_mxfp4(blocks, torch.tensor([scales], dtype=torch.uint8))
    assert out.shape == (1, 128)
    for g, s in enumerate(scales[:3]):
        want = torch.tensor([value[c] * 2.0 ** (s - 127) for c in codes])
        assert torch.equal(out[0, 32 * g:32 * (g + 1)], want)
        assert torch.equal(torch.signbit(out[0, 32 * g:32 * (g + 1)]), torch.signbit(want))   # -0.0 kept
    assert out[0, 96:].isnan().all()
    assert torch.equal(dequantize_mxfp4(blocks, torch.tensor([scales], dtype=torch.uint8), torch.bfloat16)[0, :96],
                       out[0, :96].bfloat16())
    # transformers' dequantization of random blocks ([E, out, G, 16] → its [E, in, out])
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 8, 2), generator=gen, dtype=torch.uint8)
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2),
                       convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))


def test_gpt_oss_mxfp4_experts_from_a_hub_checkpoint_and_a_gguf(tiny, tmp_path):
    """The Hub's MXFP4 `*_blocks`/`*_scales` experts, and a GGUF whose experts are MXFP4
    (llama.cpp's converter keeps them so): transformers with the experts rounded alike."""
    from safetensors.torch import load_file, save_file
    directory, hf, prompts, _ = tiny("gpt_oss")
    rounded = _rounded_through(hf, gguf.GGMLQuantizationType.MXFP4, names=_TRANSPOSED)
    greedy = hf_greedy(rounded, prompts[-1], 32)
    hub = tmp_path / "hub"
    shutil.copytree(directory, hub)
    tensors = load_file(hub / "model.safetensors")
    for name in [n for n in tensors if n.endswith(_TRANSPOSED)]:
        rows = tensors.pop(name).transpose(-1, -2)      # [E, out, in], as the Hub stores them
        tensors[name + "_blocks"], tensors[name + "_scales"] = _hub_mxfp4(rows)
    save_file(tensors, hub / "model.safetensors", metadata={"format": "pt"})
    gguf_path = write_gguf(directory, tmp_path / "gpt_oss-MXFP4_MOE.gguf", "MXFP4_MOE")
    for path in (str(hub), gguf_path):
        loaded = load_model(path, dtype=torch.float32)
        for ids in prompts:
            with torch.no_grad():
                ref = rounded(torch.tensor([ids])).logits[0, -1]
            ours = last_logits(loaded.model, loaded.config, ids)
            assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4, (path, len(ids))
        assert PagedRunner(loaded.model, loaded.config).greedy(prompts[-1], 32, chunk=16) == greedy, path


@pytest.mark.parametrize("rope", [
    # gpt-oss-20b/120b's own (truncate false), then transformers' default rounding, a given
    # attention factor, DeepSeek's mscale pair
    dict(rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
         original_max_position_embeddings=4096),
    dict(rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=4096),
    dict(rope_theta=10000.0, factor=4.0, attention_factor=0.9, original_max_position_embeddings=1024),
    dict(rope_theta=10000.0, factor=40.0, mscale=1.0, mscale_all_dim=0.707, original_max_position_embeddings=4096),
])
def test_yarn_frequencies_equal_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from guided.model.config import ModelConfig
    from guided.model.rope import inverse_frequencies
    hf = transformers.GptOssConfig(head_dim=64, num_hidden_layers=2, max_position_embeddings=131072,
                                   rope_parameters={"rope_type": "yarn", **rope})
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf)
    got, scale = inverse_frequencies(ModelConfig.from_hf(hf.to_dict()))
    assert torch.allclose(got, want, rtol=1e-6, atol=0) and math.isclose(scale, want_scale, rel_tol=1e-12)


def test_the_clamped_swiglu_equals_transformers():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from guided.model.decoder import swiglu_oai
    experts = GptOssExperts(transformers.GptOssConfig(hidden_size=8, intermediate_size=16, num_local_experts=1))
    gate_up = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 10   # far past the limit 7
    assert torch.equal(swiglu_oai(gate_up[:, 0::2], gate_up[:, 1::2], 1.702, 7.0), experts._apply_gate(gate_up))


def test_every_architecture_is_covered_by_the_tiny_models():
    from guided.model.architectures import ARCHITECTURES as ROWS
    assert {r.name for r in ROWS} <= {build_type(a) for a in ARCHS}


def build_type(arch: str) -> str:
    config = ARCHITECTURES[arch]()
    return getattr(config, "text_config", config).model_type if arch == "mistral3" else config.model_type


@pytest.mark.parametrize("arch", ARCHS)
def test_the_engine_answers_alike_after_a_prefix_cache_hit(arch, tiny):
    """Chunked prefill (16 tokens a step) and a second request whose first
    blocks come from the prefix cache: the same greedy tokens as transformers.
    (A model with Mamba layers starts the second request from the snapshot of
    its state at the prompt's last block boundary.)"""
    directory, hf, prompts, greedy = tiny(arch)
    llm = LLM(directory, dtype="float32", max_num_batched_tokens=16, kv_cache_tokens=2048)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    first = llm.generate([prompts[-1]], params, use_tqdm=False)[0].outputs[0].token_ids
    hits = llm.stats()["prefix_cache_hit_tokens"]
    again = llm.generate([prompts[-1]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert list(first) == list(again) == greedy[-1], arch
    assert llm.stats()["prefix_cache_hit_tokens"] >= hits + 64, arch
    llm.close()


#: the architectures whose scores differ from plain attention (windows, soft-caps, sinks), with
#: heads of 64, so the GPU test runs them through the CUDA decode kernel, not torch's path
WIDE_HEADS = ["mistral_swa", "gemma2", "gemma3_text", "exaone4", "gpt_oss"]


@pytest.mark.skipif(not torch.cuda.is_available() or not _native.cuda_status()[0],
                    reason=f"no GPU here: {_native.cuda_status()[1] or 'torch sees no CUDA device'}")
@pytest.mark.parametrize("arch", ARCHS + [f"{a}@64" for a in WIDE_HEADS])
def test_on_a_gpu_greedy_equals_the_cpu_path(arch, tiny, tmp_path):
    """Each architecture on the GPU in float32 (the KV write and sampling in
    our kernels; decode attention too where the head size is one the kernel
    is built for: the @64 rows, with their windows, soft-caps and sinks):
    the CPU path's greedy tokens, prompts in one batch. (The CPU path is
    transformers' in the tests above; the GPU machine's transformers may be
    another version: its Gemma 2 was seen to differ from the pinned one's.)"""
    if "@" in arch:
        name, head = arch.split("@")
        build(name, tmp_path, head_dim=int(head))
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, VOCAB - 3, (n,), generator=gen).tolist() for n in _prompt_lengths(name)]
        directory = str(tmp_path)
    else:
        directory, _, prompts, _ = tiny(arch)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    tokens = []
    for device in ("cpu", "cuda"):
        llm = LLM(directory, device=device, dtype="float32", kv_cache_tokens=4096)
        try:
            tokens.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.close()
    assert tokens[1] == tokens[0], arch


@pytest.mark.parametrize("arch", ["gemma2", "qwen3_moe", "glm4_moe"])
def test_two_ranks_give_transformers_greedy_tokens(arch, tiny):
    """A sliding, soft-capped model and two mixtures of experts (each expert's
    intermediate dimension split, GLM's shared expert too) over two ranks."""
    directory, hf, prompts, greedy = tiny(arch)
    llm = LLM(directory, dtype="float32", tensor_parallel_size=2, kv_cache_tokens=2048)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == greedy
    finally:
        llm.close()


@pytest.mark.parametrize("arch, message", [("gpt_oss", "experts have biases"), ("olmo2", "over all heads"),
                                           ("lfm2", "short-convolution layers"), ("deepseek_v3", "latent attention"),
                                           ("granitemoehybrid_mamba", "recurrent layers")])
def test_what_tensor_parallelism_cannot_split_is_refused_by_name(arch, message, tiny):
    directory = tiny(arch)[0]
    with pytest.raises(ValueError, match=message):
        LLM(directory, dtype="float32", tensor_parallel_size=2)


def test_unsupported_layers_are_refused_by_name(tmp_path):
    """Recurrent layers of an architecture whose mixer guided does not run (Granite 4.0-H's
    Mamba-2 and LFM2's convolutions are rows), layer kinds it does not know, and architectures."""
    from guided.model.config import ModelConfig
    hybrid = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
              "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
              "layer_types": ["linear_attention", "full_attention"]}
    with pytest.raises(ValueError, match="qwen3: linear-attention / recurrent layers are not supported"):
        ModelConfig.from_hf(hybrid)
    with pytest.raises(ValueError, match="layers of kind hybrid_moe"):
        ModelConfig.from_hf({**hybrid, "layer_types": ["hybrid_moe", "full_attention"]})
    with pytest.raises(ValueError, match="KimiLinearForCausalLM.*Gemma3ForCausalLM"):
        ModelConfig.from_hf({**hybrid, "architectures": ["KimiLinearForCausalLM"]})


# ---------------------------------------------------------------- the real Gemma 3 270M

@pytest.fixture(scope="module")
def gemma(gemma3_gguf):
    """float32: transformers' numbers, for the parity test."""
    return LLM(gemma3_gguf, dtype="float32", kv_cache_tokens=8192)


@pytest.fixture(scope="module")
def gemma_blocks(gemma3_gguf):
    """As users run it on a CPU: its Q4_K_M blocks, the native step."""
    return LLM(gemma3_gguf, kv_cache_tokens=8192)


def test_gemma3_greedy_equals_transformers_on_the_same_gguf(gemma, gemma3_gguf):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gemma3_gguf), gguf_file=os.path.basename(gemma3_gguf), dtype=torch.float32).eval()
    prompts = [gemma.tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    assert all(ids[0] == 2 for ids in prompts)   # <bos>, as llama.cpp adds it
    outs = gemma.generate(prompts, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, ids, 48)


def test_gemma3_ends_where_llama_cpp_does(gemma):
    special = gemma.engine.special
    ends = {special.text(i) for i in special.end_ids}
    # <eos> declared, <end_of_turn> known; "</s>" is one of its HTML tags, which it writes
    assert ends == {"<eos>", "<end_of_turn>"}, ends


def test_gemma3_answers_the_readme_prompts(gemma_blocks):
    gemma = gemma_blocks
    outs = gemma.generate(["The capital of France is"], SamplingParams(max_tokens=20, n=2, temperature=0.8),
                          use_tqdm=False)
    assert len(outs[0].outputs) == 2 and all(o.text.strip() for o in outs[0].outputs)
    greedy = gemma.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0),
                            use_tqdm=False)[0].outputs[0].text
    assert "Paris" in greedy or "capital" in greedy, greedy
    # a base model: its GGUF has no chat template, and chat() says so
    with pytest.raises(ValueError, match="no chat template"):
        gemma.chat([{"role": "user", "content": "Name three colours."}])


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "languages": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "languages"], "additionalProperties": False}


def test_gemma3_json_schema_offline_and_over_http(gemma_blocks, gemma3_gguf):
    gemma = gemma_blocks
    jsonschema = pytest.importorskip("jsonschema")
    params = SamplingParams(max_tokens=80, temperature=0.7, seed=3,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    outs = gemma.generate(["A person, as JSON: ", "Another person: "], params, use_tqdm=False)
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    with running_server("--model", gemma3_gguf) as base:
        body = {"model": "gemma-3-270m-q4_k_m", "prompt": "A person, as JSON: ", "max_tokens": 80,
                "temperature": 0.7, "seed": 5, "structured_outputs": {"json": PERSON}}
        status, _, text = post(base + "/v1/completions", json.dumps(body).encode())
        assert status == 200, text
        jsonschema.validate(json.loads(json.loads(text)["choices"][0]["text"]), PERSON)
