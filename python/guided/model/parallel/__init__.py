"""Tensor parallelism over torch.distributed: one model split across ranks.

Rank 0 is the engine: the scheduler, the block manager and the grammars run
there, and each step it broadcasts the step's flat arrays; the other ranks
only run the forward pass on their part of the weights (Megatron's split, as
in vLLM):

- attention: a rank holds whole KV-head groups (its KV heads and the query
  heads that read them): its rows of q|k|v and its columns of o_proj, whose
  partial sums are all-reduced;
- MLP: rows of gate|up (column-parallel) and columns of down_proj
  (row-parallel), all-reduced;
- embedding and LM head: a slice of the vocabulary each; the embedded rows
  are all-reduced, the logits gathered on rank 0 for the sampler.

Two all-reduces per layer. Norms and the rotary table are whole on every
rank; a rank's KV cache holds its own KV heads, with the block count agreed
(the smallest any rank can hold), so rank 0's block tables serve all.

Splits need not be even: SmolLM2-135M (9 query heads, 3 KV heads) runs on two
ranks as 2 + 1 KV-head groups. What cannot be split is refused before any
process starts: more ranks than KV heads, query heads that do not group
evenly over the KV heads, GGUF block weights (dtype="gguf"), a WORLD_SIZE
that is not the tensor-parallel size.

Processes. ``LLM(tensor_parallel_size=N)`` starts ranks 1..N-1 on this host
(``python -m guided.model.worker``, stopped with it; they split this
process's torch threads) and meets them over a TCPStore on loopback. Across hosts, every process is started by torch's own
launcher (torchrun) or by hand with the env:// variables (MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK): rank 0 runs ``python -m
guided.serve --tensor-parallel-size N``, the others the same command (they
see RANK > 0 and run the worker loop, taking what to load from rank 0).
Backend: gloo on CPU, NCCL on CUDA (one GPU per rank: cuda:LOCAL_RANK).

The package: ``split`` (what each rank holds of the weights), ``group`` (the
process group: collectives, the step broadcast, the heartbeat), ``launch``
(starting the ranks and telling them what to load).
"""
from .group import START_TIMEOUT, StepArrays, TensorGroup, failed
from .launch import SETUP_KEY, RankSetup, launched_rank, rank_device, start
from .split import TensorSplit, check_split, shard

__all__ = ["SETUP_KEY", "START_TIMEOUT", "RankSetup", "StepArrays", "TensorGroup", "TensorSplit",
           "check_split", "failed", "launched_rank", "rank_device", "shard", "start"]
