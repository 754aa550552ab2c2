"""Linear layers with bf16 weights pre-packed by oneDNN, for CPU decode.

On a CPU with AMX, a plain bf16 `F.linear` re-lays out the weight into AMX
tiles on every call; at decode batch sizes that is a third of the matmul time.
Packing once at load time removes it. The packed op is the one torch's own
compiler uses for frozen CPU models; its results are bit-identical to a bf16
`F.linear` (checked at pack time). Inputs of another dtype (fp32 activations)
are cast to bf16 on the way in and back on the way out. Where the op is
missing or disagrees, layers stay plain.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("guided.model")

# The batch-size hint oneDNN packs for; measured on 2 cores, packing for 64
# rows is as fast as packing for 16 at decode sizes and faster for prefill.
_PACK_ROWS = 64
_PACKED_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.out_features = linear.out_features
        weight = linear.weight.detach().to(torch.bfloat16)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS)
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)


def pack_linears(model: nn.Module) -> bool:
    """Swap the model's CPU linears for bf16 packed ones; False if not possible."""
    if not torch.backends.mkldnn.is_available():
        return False
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if name in _PACKED_NAMES and isinstance(child, nn.Linear)
               and child.weight.device.type == "cpu"]
    if not targets or not _agrees(targets[0][2]):
        return False
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return True


def _agrees(linear: nn.Linear) -> bool:
    probe = torch.randn(3, linear.in_features, dtype=torch.bfloat16)
    try:
        packed = PackedLinear(linear)(probe)
    except (RuntimeError, AttributeError) as exc:
        log.info("oneDNN weight packing unavailable (%s); using plain linears", exc)
        return False
    bias = None if linear.bias is None else linear.bias.to(torch.bfloat16)
    return torch.equal(packed, nn.functional.linear(probe, linear.weight.to(torch.bfloat16), bias))
