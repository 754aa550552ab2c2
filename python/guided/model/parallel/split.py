"""Splitting a model's weights over tensor-parallel ranks (Megatron's split:
see the package's docstring): what each rank holds, whether a model can be
split at all, and keeping one rank's part of a loaded model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config import ModelConfig

if TYPE_CHECKING:
    from .group import TensorGroup


def _even(n: int, size: int, rank: int) -> range:
    """Rank ``rank``'s share of ``n`` items split as evenly as they go."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def check_split(config: ModelConfig, size: int, dtype=None) -> None:
    """Raise ValueError where ``config`` (loaded as ``dtype``) cannot be split over ``size`` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, not {size}")
    if dtype == "gguf" and size > 1:
        raise ValueError("tensor parallelism splits dense weights; dtype='gguf' keeps GGUF blocks "
                         "(use float32 or bfloat16)")
    if config.num_heads % config.num_kv_heads:
        raise ValueError(f"the model's {config.num_heads} attention heads do not group evenly over "
                         f"its {config.num_kv_heads} KV heads")
    if size > 1 and config.qk_norm == "full":
        raise ValueError(f"{config.architecture} normalises queries and keys over all heads at once; "
                         f"tensor parallelism splits heads over ranks, which is not supported for it yet")
    if size > 1 and config.moe is not None and config.moe.expert_bias:
        raise ValueError(f"{config.architecture}'s experts have biases, which tensor parallelism "
                         f"does not split yet")
    if size > 1 and config.latent is not None:
        raise ValueError(f"{config.architecture}'s latent attention is not split over ranks by tensor "
                         f"parallelism yet; run it with tensor_parallel_size=1")
    if size > 1 and config.state_shape is not None:
        raise ValueError(f"{config.architecture}'s recurrent layers (Mamba-2, Gated DeltaNet) are not split over "
                         f"ranks by tensor parallelism yet; run it with tensor_parallel_size=1")
    if size > 1 and "conv" in config.layer_types:
        raise ValueError(f"{config.architecture}'s short-convolution layers are not split over ranks by "
                         f"tensor parallelism yet; run it with tensor_parallel_size=1")
    if size > 1 and (config.output_bias or config.mlp_bias):
        raise ValueError(f"{config.architecture} has biases on o_proj or down_proj, which tensor "
                         f"parallelism does not split yet")
    if size > config.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={size} is more than the model's {config.num_kv_heads} KV heads: "
            f"each rank holds whole KV heads with the query heads that read them, so at most "
            f"{config.num_kv_heads} ranks")


@dataclass(frozen=True)
class TensorSplit:
    """What one rank holds of a model."""

    rank: int
    size: int
    kv_heads: range
    heads: range          # the query heads that read this rank's KV heads
    intermediate: range   # MLP rows
    vocab: range          # embedding and LM-head rows
    vocab_size: int       # the whole vocabulary's

    @property
    def vocab_piece(self) -> int:
        """The largest rank's vocabulary slice: logits are gathered padded to it."""
        return -(-self.vocab_size // self.size)

    @property
    def vocab_sizes(self) -> list[int]:
        """Every rank's vocabulary slice, by rank."""
        return [len(_even(self.vocab_size, self.size, r)) for r in range(self.size)]

    @classmethod
    def of(cls, config: ModelConfig, rank: int, size: int) -> "TensorSplit":
        kv = _even(config.num_kv_heads, size, rank)
        group = config.num_heads // config.num_kv_heads
        return cls(rank, size, kv, range(kv.start * group, kv.stop * group),
                   _even(config.intermediate_size, size, rank), _even(config.vocab_size, size, rank),
                   config.vocab_size)


def shard(model: nn.Module, split: TensorSplit, group: "TensorGroup") -> None:
    """Keep this rank's part of a loaded (dense) CausalLM and wire its collectives."""
    c, d = model.config, model.config.head_dim
    q_size, kv_size, mid = c.num_heads * d, c.num_kv_heads * d, c.intermediate_size
    heads = slice(split.heads.start * d, split.heads.stop * d)
    kv = split.kv_heads.start * d, split.kv_heads.stop * d
    rows = slice(split.intermediate.start, split.intermediate.stop)
    for layer in model.layers:
        _keep_rows(layer.qkv_proj, [heads, slice(q_size + kv[0], q_size + kv[1]),
                                    slice(q_size + kv_size + kv[0], q_size + kv_size + kv[1])])
        _keep_columns(layer.o_proj, heads)
        if layer.moe is not None:
            _shard_experts(layer.moe, split)
        else:
            _keep_rows(layer.gate_up_proj, [rows, slice(mid + rows.start, mid + rows.stop)])
            _keep_columns(layer.down_proj, rows)
        if layer.sinks is not None:
            layer.sinks = nn.Parameter(layer.sinks[split.heads.start:split.heads.stop].clone(),
                                       requires_grad=False)
        layer.num_heads, layer.num_kv_heads = len(split.heads), len(split.kv_heads)
        layer.q_size, layer.kv_size = len(split.heads) * d, len(split.kv_heads) * d
        layer.reduce = group.all_reduce
    vocab = slice(split.vocab.start, split.vocab.stop)
    embed = model.embed_tokens
    embed.weight = nn.Parameter(embed.weight[vocab].clone(), requires_grad=False)
    embed.num_embeddings = len(split.vocab)
    _keep_rows(model.lm_head, [vocab])
    model.tensor_group, model.vocab_start = group, split.vocab.start
    group.split = split


def _shard_experts(moe: nn.Module, split: TensorSplit) -> None:
    """Every expert (and the shared one) keeps its slice of the intermediate
    dimension, as a dense MLP does; the router stays whole, so every rank
    picks the same experts, and the weighted partial outputs sum to the whole."""
    def keep(gate_up: torch.Tensor, down: torch.Tensor, width: int) -> tuple[nn.Parameter, nn.Parameter]:
        part = _even(width, split.size, split.rank)
        rows = torch.cat([torch.arange(part.start, part.stop), torch.arange(width + part.start, width + part.stop)])
        return (nn.Parameter(gate_up.index_select(-2, rows), requires_grad=False),
                nn.Parameter(down[..., part.start:part.stop].clone(), requires_grad=False))
    m = moe.config
    moe.gate_up, moe.down = keep(moe.gate_up, moe.down, m.intermediate_size)
    if m.shared_intermediate_size:
        moe.shared_gate_up, moe.shared_down = keep(moe.shared_gate_up, moe.shared_down,
                                                   m.shared_intermediate_size)


def _keep_rows(linear: nn.Linear, parts: list[slice]) -> None:
    """Column-parallel: this rank's output rows (from one or more fused parts)."""
    linear.weight = nn.Parameter(torch.cat([linear.weight[p] for p in parts]), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(torch.cat([linear.bias[p] for p in parts]), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _keep_columns(linear: nn.Linear, part: slice) -> None:
    """Row-parallel: this rank's input columns; the partial outputs are summed by all-reduce."""
    assert linear.bias is None, "a row-parallel layer's bias would be added once per rank"
    linear.weight = nn.Parameter(linear.weight[:, part].clone(), requires_grad=False)
    linear.in_features = linear.weight.shape[1]

