"""Linear layers that keep a GGUF's quantized weights as stored (CPU).

Decode on a CPU is bound by reading the weights: a Q4_1 matrix is a fifth of
its fp32 bytes. `QuantLinear` holds the tensor's blocks in a native
`QuantMatrix`, repacked for the multi-row kernels (rust/cpu/packed.rs; ggml's
one-row kernels for Q2_K/Q3_K), which quantize the activations to 8 bits as
llama.cpp does. The native CPU step (model/native.py) shares those matrices.

Every row of every call takes that one path, whatever the number of rows:
a row's result is then the same in a decode step, a prefill chunk of any
size, or a batch shared with other requests (each output is computed by the
same operations whatever rows share the call). A dense GEMM over dequantized copies is faster for long
prefills, but it rounds differently from the 8-bit path, and a request's
greedy answer then changed with the chunk it was prefilled in or with what
other users had cached (issue 38).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
from torch import nn

from .. import _native

if TYPE_CHECKING:
    from .pack_cache import PackCache

#: ggml type id → name, for the formats with a quantized kernel on this build.
FORMATS = dict((ty, name) for name, ty in _native.quant_formats())

def kernels_available() -> bool:
    return _native.quant_kernels() is not None


@dataclass(frozen=True)
class QuantWeight:
    """A GGUF weight's raw blocks, read on demand: uint8 `shape` [rows, row_bytes] (rows =
    output features; a GGUF's 3-D experts [experts, rows, row_bytes]). `read` gives them (a
    view of the file, or a copy with rows moved); `key` names them: the tensors they come from
    and the row moves made (the pack cache's name for their matrix). A load that finds every
    matrix in its `cache` never reads a block."""
    ggml_type: int
    cols: int
    shape: tuple[int, ...]
    read: Callable[[], np.ndarray]
    key: str
    cache: PackCache | None = None

    def matrix(self) -> _native.QuantMatrix:
        """The native matrix: taken back from the cache, else packed (and kept for the cache)."""
        if self.cache is not None and (found := self.cache.get(self)) is not None:
            return found
        data = np.ascontiguousarray(self.read()).reshape(-1)
        m = _native.QuantMatrix(self.ggml_type, self.shape[0], self.cols, data)
        if self.cache is not None:
            self.cache.add(self, m)
        return m

    def dense(self) -> torch.Tensor:
        return torch.from_numpy(replace(self, cache=None).matrix().dequantize())

    def moved(self, how: str, move: Callable[[torch.Tensor], torch.Tensor]) -> QuantWeight:
        """The rows moved by `move` (whole rows: a permutation, named `how` in the key)."""
        return replace(self, read=lambda: move(torch.from_numpy(np.array(self.read()))).numpy(),
                       key=f"{self.key}|{how}")

    def expert(self, e: int) -> QuantWeight:
        """Expert `e`'s rows of a 3-D expert tensor."""
        return replace(self, shape=self.shape[1:], read=lambda: self.read()[e], key=f"{self.key}[{e}]")

    @staticmethod
    def concat(parts: list[QuantWeight]) -> QuantWeight | list[QuantWeight] | None:
        """The parts stacked by rows (fused q|k|v, gate|up): one weight where they share a
        format, the list where their formats differ, None where their widths differ."""
        if len({p.cols for p in parts}) != 1:
            return None
        if len({p.ggml_type for p in parts}) != 1:
            return list(parts)
        return replace(parts[0], shape=(sum(p.shape[0] for p in parts), *parts[0].shape[1:]),
                       read=lambda: np.concatenate([p.read() for p in parts]),
                       key="+".join(p.key for p in parts))


class QuantEmbedding(nn.Module):
    """A token table kept in its GGUF blocks: each looked-up row dequantized by ggml's
    routine, the values a dense table dequantized from the same blocks holds. Where the
    embeddings are tied, the output head's QuantLinear holds the same matrix."""

    def __init__(self, matrix: _native.QuantMatrix, dtype: torch.dtype):
        super().__init__()
        self.matrix, self.dtype = matrix, dtype
        self.num_embeddings, self.embedding_dim = matrix.rows, matrix.cols

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.matrix.dequantize_rows(ids.reshape(-1).to(torch.int64).numpy())
        return torch.from_numpy(rows).view(*ids.shape, self.embedding_dim).to(self.dtype)


class QuantLinear(nn.Module):
    """One matrix, or several stacked by rows where a fused layer's parts
    differ in format (Gemma 3's q and k in Q5_0 with v in Q8_0).

    `precise` (the output head): the activations' 8-bit rounding error gets
    a second pass through the kernel (about 16-bit activations), so fewer
    near-tied tokens swap on it (SmolLM2's top token agrees with float32's at
    97.9% of the parity prompts' positions with it, 97.2% without). Where the
    weights are packed the second pass runs only on the groups of rows that
    could hold a row's largest output (a bound per 32-column block, which
    leaves a handful of SmolLM2's 6144 groups), so every row's top has its
    bits; the other outputs keep the 8-bit product (rust/cpu/packed.rs)."""

    def __init__(self, matrices: _native.QuantMatrix | list[_native.QuantMatrix], bias: bool,
                 precise: bool = False):
        super().__init__()
        self.matrices = list(matrices) if isinstance(matrices, (list, tuple)) else [matrices]
        if len({m.cols for m in self.matrices}) != 1:
            raise ValueError(f"stacked matrices differ in width: {[m.cols for m in self.matrices]}")
        self.precise = precise
        self.in_features, self.out_features = self.matrices[0].cols, sum(m.rows for m in self.matrices)
        self.bias = nn.Parameter(torch.empty(self.out_features, device="meta"), requires_grad=False) \
            if bias else None

    @property
    def formats(self) -> set[str]:
        return {m.format for m in self.matrices}

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.matrices)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float().contiguous()
        outs = [torch.empty(rows.shape[0], m.rows) for m in self.matrices]
        for m, out in zip(self.matrices, outs):
            m.matmul(rows.numpy(), out.numpy(), self.precise)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{'+'.join(m.format for m in self.matrices)}, in_features={self.in_features}, " \
               f"out_features={self.out_features}"
