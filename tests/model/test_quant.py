"""Quantized linears (ggml's CPU kernels through rust/cpu/quant.rs) against
dequantize-then-matmul, for every GGUF block format with a kernel; the
dequantization checked against the `gguf` package's own, an independent
implementation. And the quantized default model end to end."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType

from guided import _native

pytestmark = pytest.mark.skipif(_native.quant_kernels() is None,
                                reason="no build of ggml's quantized kernels runs on this CPU")

FORMATS = dict(_native.quant_formats())


def _blocks(name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """A random matrix as ggml rows of format `name` (a GGUF tensor's bytes), by ggml's quantizer."""
    rng = np.random.default_rng(seed)
    dense = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    return _native.ggml_quantize(FORMATS[name], dense)


def _matrix(name: str, rows: int, cols: int, seed: int) -> _native.QuantMatrix:
    return _native.QuantMatrix(FORMATS[name], rows, cols, _blocks(name, rows, cols, seed))


def test_every_supported_format_is_a_gguf_format():
    assert set(FORMATS) == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
    for name, ty in FORMATS.items():
        assert GGMLQuantizationType[name] == ty


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_quantized_matmul_equals_dequantize_then_matmul(name):
    rows, cols = 96, 512
    blocks = _blocks(name, rows, cols, seed=FORMATS[name])
    m = _native.QuantMatrix(FORMATS[name], rows, cols, blocks)
    assert (m.rows, m.cols, m.format) == (rows, cols, name)
    # repacked for the multi-row kernels where the format has a packing (rust/cpu/packed.rs)
    assert m.packed == (name not in ("Q2_K", "Q3_K"))
    dense = m.dequantize()
    # the matrix holds the values the gguf package reads from the same bytes (packed or not)
    np.testing.assert_array_equal(dense, quants.dequantize(blocks.reshape(rows, -1), GGMLQuantizationType[name]))
    rng = np.random.default_rng(1)
    for batch in (1, 3, 16):
        x = rng.standard_normal((batch, cols)).astype(np.float32)
        want = x.astype(np.float64) @ dense.T.astype(np.float64)
        scale = np.abs(x) @ np.abs(dense).T    # what the rounding of 8-bit activations is relative to
        for precise in (False, True):
            out = np.full((batch, rows), np.nan, dtype=np.float32)
            m.matmul(x, out, precise)
            err = np.abs(out - want) / scale
            assert err.max() < 2e-2, (name, batch, precise, err.max())
            if precise:   # the second pass where a row's largest output can be: at least there
                top = err[np.arange(batch), out.argmax(axis=1)]
                assert top.max() < 2e-4, (name, batch, top.max())
    # rows are independent: one row alone gives what it gives in a batch (batch invariance)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    whole = np.empty((5, rows), np.float32)
    m.matmul(x, whole)
    for i in range(5):
        one = np.empty((1, rows), np.float32)
        m.matmul(x[i:i + 1], one)
        np.testing.assert_array_equal(one[0], whole[i])


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(FORMATS)), rows=st.integers(1, 40), blocks=st.integers(1, 3),
       batch=st.integers(1, 70), precise=st.booleans(), seed=st.integers(0, 2**16))
def test_any_shape_and_batch_gives_each_row_its_own_product(name, rows, blocks, batch, precise, seed):
    """Generated shapes (rows not a multiple of the eight interleaved, one to three
    blocks of the format's width), batches across the kernels' tiles of 4 or 8 rows
    and the 64-row task split: each output is the dense product up to the 8-bit
    activations' rounding (a row's largest, when precise, up to about 16-bit
    activations'), and each row alone gives its bits in the batch."""
    width = 256 if name.endswith("_K") else 32
    m = _matrix(name, rows, blocks * width, seed=seed)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((batch, m.cols)) * rng.uniform(0.01, 10)).astype(np.float32)
    out = np.full((batch, rows), np.nan, np.float32)
    m.matmul(x, out, precise)
    dense = m.dequantize().astype(np.float64)
    scale = np.abs(x) @ np.abs(dense).T + 1e-30
    err = np.abs(out - x.astype(np.float64) @ dense.T) / scale
    assert err.max() < 2e-2
    if precise:   # each row's largest output has the second pass
        assert err[np.arange(batch), out.argmax(axis=1)].max() < 2e-4
    for i in sorted({0, batch // 2, batch - 1}):
        one = np.empty((1, rows), np.float32)
        m.matmul(x[i:i + 1], one, precise)
        np.testing.assert_array_equal(one[0], out[i])


def test_bad_input_is_refused_with_what_was_wrong():
    q4_1 = FORMATS["Q4_1"]
    with pytest.raises(ValueError, match="not whole 32-element blocks"):
        _native.QuantMatrix(q4_1, 2, 48, np.zeros(60, np.uint8))
    with pytest.raises(ValueError, match="takes 40"):
        _native.QuantMatrix(q4_1, 2, 32, np.zeros(41, np.uint8))
    with pytest.raises(ValueError, match="no quantized CPU kernel"):
        _native.QuantMatrix(int(GGMLQuantizationType.F16), 2, 32, np.zeros(128, np.uint8))
    m = _matrix("Q4_1", 4, 64, seed=0)
    with pytest.raises(ValueError, match=r"matmul of x \[2, 32\]"):
        m.matmul(np.zeros((2, 32), np.float32), np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="dequantize into"):
        m.dequantize(np.zeros((4, 63), np.float32))


def test_quant_linear_takes_the_kernel_for_every_row_count():
    """A long prefill's rows go through the same 8-bit kernel as a decode's
    single row: each row of a 96-row call is, to the bit, the row alone (a
    dense GEMM for many rows would round otherwise, and a request's answer
    would change with the chunk it was prefilled in)."""
    from guided.model.quant_linear import QuantLinear
    m = _matrix("Q4_1", 64, 256, seed=3)
    layer = QuantLinear(m, bias=False)
    x = torch.randn(96, 256)
    whole = layer(x)
    for i in (0, 17, 95):
        assert torch.equal(layer(x[i:i + 1])[0], whole[i])
    dense = x @ torch.from_numpy(m.dequantize()).T
    assert ((whole - dense).abs() / (x.abs() @ torch.from_numpy(np.abs(m.dequantize())).T)).max() < 2e-2


def test_the_default_keeps_the_models_formats_and_tracks_fp32(llm):
    """LLM() on a CPU runs the GGUF's own blocks: Q4_1 layers and the Q8_0 output
    head tied to the embeddings, 8-bit activations as llama.cpp, no dense copy
    of any quantized weight (the embeddings are looked up in the head's blocks,
    ggml's values for each row). Teacher-forced on the fp32 model's own greedy
    continuations (48 tokens of each parity prompt), its next-token
    distributions stay the fp32 model's: the same top token at ≥ 90% of the
    positions, a mean KL divergence under 0.05 nats."""
    from guided import LLM, SamplingParams
    from guided.model.quant_linear import QuantEmbedding, QuantLinear
    from helpers.paged import PagedRunner
    from helpers.prompts import PROMPTS
    quantized = LLM(max_num_seqs=4, kv_cache_tokens=2048)
    assert quantized.loaded.weight_formats == ("Q4_1", "Q8_0")
    model = quantized.loaded.model
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * quantized.loaded.config.num_layers + 1
    assert sum(m.nbytes for m in layers) < 100e6   # ~92 MB, where fp32 takes 540 MB
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
    assert dense < 1e6   # the norms: no dense copy of a QuantLinear, no dense embedding table (113 MB)
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.matrix is model.lm_head.matrices[0]
    ids = torch.tensor([[0, 17], [49151, 17]])
    table = model.lm_head.matrices[0].dequantize()
    assert torch.equal(model.embed_tokens(ids), torch.from_numpy(table[ids.numpy()]))
    with pytest.raises(ValueError, match="row 49152 of a matrix of 49152 rows"):
        model.embed_tokens(torch.tensor([49152]))
    agree, kl, n = 0, 0.0, 0
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48,
                                                                         ignore_eos=True))):
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        logprobs = []
        for loaded in (llm.loaded, quantized.loaded):
            hidden = PagedRunner(loaded.model, loaded.config).step({0: ids})
            logprobs.append(torch.log_softmax(loaded.model.compute_logits(hidden[len(out.prompt_token_ids) - 1:-1]), -1))
        fp32, quant = logprobs
        agree += int((fp32.argmax(-1) == quant.argmax(-1)).sum())
        kl += float((fp32.exp() * (fp32 - quant)).sum())
        n += fp32.shape[0]
    assert agree / n >= 0.9 and kl / n < 0.05, (agree / n, kl / n)
