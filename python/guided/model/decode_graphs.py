"""Decode steps as CUDA graphs, one per bucket of batch sizes.

A decode step of a small model is launch-bound on a GPU: SmolLM2-135M's
weights are read in ~0.1 ms, yet its eager step took 12.4 ms on an H100, the
host issuing some 300 kernel launches one by one. The runner captures one
graph per bucket (1, 2, 4, 8, then every multiple of 8 up to max_num_seqs)
at start, largest first, all sharing one memory pool, and replays the
smallest that holds a decode step: one new token per sequence, each row
sampled. Prefill and mixed steps stay eager, as do steps over the largest
bucket.

A graph reads its inputs from static buffers: the step's arrays are copied
into their first rows before each replay, and logits come back from its
static output (the device sampler reads them right after, on the same
stream). Rows past the step's sequences are padding: token 0 at position 0,
writing and reading a KV block of their own that the scheduler never hands
out (``pad_block``), so they touch no sequence's cache, and every layer
computes a row from that row alone (attention, norms, the linears), so
padding never changes a sequence's tokens.

Modes (``LLM(cuda_graphs=...)``, ``--cuda-graphs``): "auto" captures on
CUDA where our kernels run the decode attention (the torch fallback's
shapes follow the longest context); "off" runs every step eagerly;
"padded" runs the buckets and static buffers without capturing: the same
rows and the same padding, eager. On a CPU (the torch step) that is what
the tests run with the reference kernels standing in; on a GPU it tells a
capture bug from a padding bug.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable

import numpy as np
import torch

from .attention import AttentionMetadata

log = logging.getLogger("guided.model")

#: LLM(cuda_graphs=...) and --cuda-graphs
GRAPH_MODES = ("auto", "off", "padded")


def buckets(max_batch: int) -> list[int]:
    """The batch sizes a graph is kept for: 1, 2, 4, then every multiple of 8
    below max_batch, and max_batch itself (vLLM's and SGLang's spacing)."""
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch}: at least 1")
    return [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8)) + [max_batch]


#: a bucket's forward: (input ids, positions, metadata) → float32 logits, one row per input row
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphs:
    """Static buffers for the largest bucket, and a captured graph per bucket
    (none where ``capture`` is False: "padded")."""

    def __init__(self, forward: Forward, device: torch.device, *, max_batch: int, max_blocks: int,
                 block_size: int, pad_block: int, max_context_len: int, kernels: bool,
                 native_only: bool, capture: bool):
        self.forward, self.device, self.sizes = forward, device, buckets(max_batch)
        self.block_size, self.pad_block = block_size, pad_block
        self.max_context_len, self.kernels, self.native_only = max_context_len, kernels, native_only
        n, i64, i32 = self.sizes[-1], torch.int64, torch.int32
        self.input_ids = torch.zeros(n, dtype=i64, device=device)
        self.positions = torch.zeros(n, dtype=i64, device=device)
        self.slot_mapping = torch.full((n,), pad_block * block_size, dtype=i64, device=device)
        self.block_tables = torch.full((n, max_blocks), pad_block, dtype=i32, device=device)
        self.context_lens = torch.ones(n, dtype=i32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=i32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        #: steps run per bucket, replayed or (padded) eager
        self.steps: Counter[int] = Counter()
        if capture:
            self._capture()

    def bucket(self, plan) -> int | None:
        """The bucket that runs ``plan`` (a ``_native.StepPlan``), or None: eager."""
        n = len(plan.seq_ids)
        if not plan.is_decode_only or plan.num_tokens != n or len(plan.logits_indices) != n \
                or n > self.sizes[-1] or plan.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        return next(b for b in self.sizes if b >= n)

    def run(self, plan, bucket: int) -> torch.Tensor:
        """float32 logits [sequences, vocabulary] of a decode step, from its bucket."""
        n = len(plan.seq_ids)
        self._load(plan, n, bucket)
        self.steps[bucket] += 1
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            return self.outputs[bucket][:n]
        return self._forward(bucket)[:n]

    def _forward(self, bucket: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], block_tables=self.block_tables[:bucket],
            context_lens=self.context_lens[:bucket], query_start_loc=self.query_start_loc[:bucket + 1],
            max_query_len=1, max_context_len=self.max_context_len, block_size=self.block_size,
            is_decode_only=True, kernels=self.kernels, native_only=self.native_only)
        return self.forward(self.input_ids[:bucket], self.positions[:bucket], meta)

    def _load(self, plan, n: int, bucket: int) -> None:
        """The step's rows into the buffers' first n rows, padding into the rest
        of the bucket (rows a larger step left there included). A table's
        columns past the step's width keep what they held: a row reads only
        the blocks its context covers."""
        for buffer, values in ((self.input_ids, plan.input_ids), (self.positions, plan.positions),
                               (self.slot_mapping, plan.slot_mapping), (self.context_lens, plan.context_lens)):
            buffer[:n].copy_(torch.from_numpy(values), non_blocking=True)
        tables = plan.block_tables
        self.block_tables[:n, :tables.shape[1]].copy_(torch.from_numpy(np.ascontiguousarray(tables)),
                                                      non_blocking=True)
        if bucket > n:
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.slot_mapping[n:bucket].fill_(self.pad_block * self.block_size)
            self.block_tables[n:bucket].fill_(self.pad_block)
            self.context_lens[n:bucket].fill_(1)

    def _capture(self) -> None:
        """One graph per bucket, largest first, in one memory pool; a bucket
        that cannot be captured leaves every decode step eager, with a warning."""
        started, pool = time.perf_counter(), None
        side = torch.cuda.Stream(self.device)
        for bucket in reversed(self.sizes):
            try:
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):   # warm-up: lazily built tables, cuBLAS workspaces
                    for _ in range(2):
                        self._forward(bucket)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bucket] = self._forward(bucket)
            except (RuntimeError, ValueError) as exc:   # an op that cannot be captured; a launcher's check
                log.warning("decode steps run eagerly: capturing a CUDA graph for a batch of %d failed (%s)",
                            bucket, exc)
                self.graphs.clear()
                self.outputs.clear()
                return
            self.graphs[bucket], pool = graph, graph.pool()
        torch.cuda.synchronize(self.device)
        log.info("decode steps: CUDA graphs captured for batch sizes %s in %.1f s (--cuda-graphs off: eager)",
                 ",".join(map(str, self.sizes)), time.perf_counter() - started)
