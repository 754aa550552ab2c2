"""Linear layers that keep a GGUF's quantized weights as stored (CPU).

Decode on a CPU is bound by reading the weights: a Q4_1 matrix is a fifth of
its fp32 bytes. `QuantLinear` holds the tensor's blocks in a native
`QuantMatrix` and multiplies through ggml's own kernels (rust/quant.rs),
which quantize the activations to 8 bits as llama.cpp does. From some number
of rows on (a prefill), a dense GEMM beats the block dot products, which
unpack the weight again for every row: there torch multiplies a dense copy
of the weight. The copies are kept where they fit a share of the machine's
memory (`DENSE_COPY_SHARE`; SmolLM2 takes 0.4 GB more); otherwise the
matrix is dequantized into a scratch buffer for each such call.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .. import _native

#: ggml type id → name, for the formats with a quantized kernel on this build.
FORMATS = dict((ty, name) for name, ty in _native.quant_formats())

#: From this many rows on, a dense GEMM is faster than the block dot products.
#: Measured on a 2-core AVX2 EPYC over SmolLM2's 30 layers (weights streamed
#: from memory, as in a step): Q4_1 ties fp32 at 16 rows and loses from 32;
#: the output head's Q8_0, whose dot product is cheaper, ties at 64.
DENSE_FROM_ROWS = {"Q8_0": 64}
DENSE_FROM_ROWS_DEFAULT = 24

#: The share of physical memory that dense copies of the quantized weights may
#: take (for the GEMM of long prefills); past it no copy is kept.
DENSE_COPY_SHARE = 1 / 8


def dense_copy_budget() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * DENSE_COPY_SHARE)
    except (ValueError, OSError):
        return 0


def kernels_available() -> bool:
    return _native.quant_kernels() is not None


@dataclass
class QuantWeight:
    """A GGUF weight's raw blocks: [rows, row_bytes] uint8, rows = output features."""
    ggml_type: int
    cols: int
    blocks: torch.Tensor

    def matrix(self) -> _native.QuantMatrix:
        data = self.blocks.contiguous().numpy().reshape(-1)
        return _native.QuantMatrix(self.ggml_type, self.blocks.shape[0], self.cols, data)

    def dense(self) -> torch.Tensor:
        return torch.from_numpy(self.matrix().dequantize())

    @staticmethod
    def concat(parts: list[QuantWeight]) -> QuantWeight | None:
        """The parts stacked by rows (fused q|k|v, gate|up), or None if their formats differ."""
        if len({(p.ggml_type, p.cols) for p in parts}) != 1:
            return None
        return QuantWeight(parts[0].ggml_type, parts[0].cols, torch.cat([p.blocks for p in parts]))


class DenseScratch:
    """One float32 buffer, grown to the largest matrix dequantized into it; the
    model's QuantLinears share it (they run one at a time)."""

    def __init__(self):
        self._buf = np.empty(0, dtype=np.float32)

    def dense(self, matrix: _native.QuantMatrix) -> torch.Tensor:
        n = matrix.rows * matrix.cols
        if self._buf.size < n:
            self._buf = np.empty(n, dtype=np.float32)
        out = self._buf[:n].reshape(matrix.rows, matrix.cols)
        return torch.from_numpy(matrix.dequantize(out))


class QuantLinear(nn.Module):
    """`dense`: the weight dequantized (fp32), for calls of many rows; None:
    dequantize into `scratch` for each such call. `precise` (the output
    head): the activations' 8-bit rounding error gets a second pass through
    the kernel, so two near-tied tokens do not swap on it (SmolLM2 answers
    "L'Étoile, ..." for "Paris" without it, as llama.cpp does on the same
    GGUF); it costs a second dot product over weight rows already in cache."""

    def __init__(self, matrix: _native.QuantMatrix, bias: bool, scratch: DenseScratch,
                 dense: torch.Tensor | None = None, precise: bool = False):
        super().__init__()
        self.matrix = matrix
        self.dense, self.precise = dense, precise
        self.in_features, self.out_features = self.matrix.cols, self.matrix.rows
        self.bias = nn.Parameter(torch.empty(self.out_features, device="meta"), requires_grad=False) \
            if bias else None
        self.dense_from_rows = DENSE_FROM_ROWS.get(self.matrix.format, DENSE_FROM_ROWS_DEFAULT)
        self.scratch = scratch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] >= self.dense_from_rows:
            dense = self.dense if self.dense is not None else self.scratch.dense(self.matrix)
            out = nn.functional.linear(rows.float(), dense)
        else:
            rows = rows.float().contiguous()
            out = torch.empty(rows.shape[0], self.out_features)
            self.matrix.matmul(rows.numpy(), out.numpy(), self.precise)
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.matrix.format}, in_features={self.in_features}, out_features={self.out_features}"
