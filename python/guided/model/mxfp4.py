"""MXFP4 (OCP Microscaling Formats v1.0): blocks of 32 FP4 E2M1 values sharing one
E8M0 scale, as gpt-oss's Hub checkpoints store their experts (`*_blocks` [.., G, 16]
uint8, two values a byte with the first in the low nibble, and `*_scales` [.., G]
uint8). Dequantized once at load; the experts then run dense."""
from __future__ import annotations

import torch

#: E2M1 by code: sign bit, two exponent bits (bias 1), one mantissa bit; codes 0b0001 and
#: 0b1001 are the subnormals ±0.5
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_SCALE_BIAS, _SCALE_NAN = 127, 255


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
                     rows_per_chunk: int = 1 << 20) -> torch.Tensor:
    """[..., G, 16] uint8 blocks and [..., G] uint8 scales → [..., G * 32] of `dtype`:
    each value is its E2M1 code's number times 2^(scale − 127); a scale of 255 is NaN.
    Exact in float32 and bfloat16 (a value needs two significant bits)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(32 values, 16 bytes, per scale)")
    work = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    lut = torch.tensor(FP4_E2M1, dtype=work)
    *lead, groups, _ = blocks.shape
    flat, exps = blocks.reshape(-1, 16), scales.reshape(-1)
    out = torch.empty(flat.shape[0], 32, dtype=work)
    for r in range(0, flat.shape[0], rows_per_chunk):
        b, e, o = flat[r:r + rows_per_chunk], exps[r:r + rows_per_chunk], out[r:r + rows_per_chunk]
        o[:, 0::2] = lut[(b & 0x0F).int()]
        o[:, 1::2] = lut[(b >> 4).int()]
        factor = torch.pow(2.0, e.to(torch.float32) - _SCALE_BIAS)
        o.copy_((o.float() * factor[:, None]).masked_fill((e == _SCALE_NAN)[:, None], float("nan")))
    return out.view(*lead, groups * 32).to(dtype)
