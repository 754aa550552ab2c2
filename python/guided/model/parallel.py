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
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..processes import die_with_parent, free_port
from .config import ModelConfig

log = logging.getLogger("guided.model.parallel")

#: how long a collective may wait. Steps are short; an idle rank 0 sends a
#: heartbeat every HEARTBEAT_SECONDS so the waiting ranks never reach it.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
HEARTBEAT_SECONDS = 30.0
#: how long rank 0 waits for the other ranks to load their parts
START_TIMEOUT = timedelta(minutes=30)
#: how often the other ranks report their step counts and times to rank 0 (metrics)
STATS_SECONDS = 1.0

_STOP, _STEP, _BEAT = 0, 1, 2
_HEADER = 8   # command, T, B, M (block-table columns), R, max_query_len, max_context_len, decode-only
SETUP_KEY = "guided/setup"   # what rank 0 tells the others to load (RankSetup as JSON)


def failed(rank: int) -> str:
    """The store key where a rank that could not load says why."""
    return f"guided/failed/{rank}"


def _loaded(rank: int) -> str:
    return f"guided/loaded/{rank}"


def _stats(rank: int) -> str:
    return f"guided/stats/{rank}"


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
        _keep_rows(layer.gate_up_proj, [rows, slice(mid + rows.start, mid + rows.stop)])
        _keep_columns(layer.down_proj, rows)
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


@dataclass
class StepArrays:
    """A step's flat arrays as a rank other than 0 receives them (the
    attributes of ``_native.StepPlan`` that the forward pass reads)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    context_lens: np.ndarray
    query_start_loc: np.ndarray
    logits_indices: np.ndarray
    max_query_len: int
    max_context_len: int
    is_decode_only: bool

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


class TensorGroup:
    """This process's rank in a tensor-parallel group: the collectives the
    model calls, the step broadcast, and (on rank 0) the other ranks' lives."""

    def __init__(self, rank: int, size: int, device: torch.device, store: dist.Store,
                 workers: list[subprocess.Popen] | None = None, threads: int | None = None):
        self.rank, self.size, self.device = rank, size, device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        # NCCL moves CUDA tensors only; gloo moves CPU ones
        self._wire = device if self.backend == "nccl" else torch.device("cpu")
        self.store = store
        self.workers = workers or []
        #: torch threads for a step on this rank (ranks started here split this process's), or None
        self.threads = threads
        self.split: TensorSplit | None = None   # set by shard()
        self.broken: str | None = None
        self._lock = threading.Lock()
        self._store_lock = threading.Lock()   # the store's client is used from several threads
        self._last = self._reported = time.monotonic()
        #: this rank's forward passes and the seconds they took (step broadcast included)
        self.steps, self.forward_seconds = 0, 0.0
        self._connected = self._closed = False

    # -- start and stop ----------------------------------------------------

    def connect(self) -> None:
        """Form the process group once every rank has loaded its part (on rank
        0: waits for them, and raises if one fails or exits while loading)."""
        if self.rank == 0:
            self._wait_for_ranks()
        else:
            self.store.set(_loaded(self.rank), "1")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(self.backend, store=self.store, rank=self.rank,
                                world_size=self.size, timeout=COLLECTIVE_TIMEOUT)
        self._connected = True
        if self.rank == 0:
            threading.Thread(target=self._heartbeat, name="guided-tp-heartbeat", daemon=True).start()
            atexit.register(self.close)
        log.info("tensor-parallel rank %d of %d on %s (%s)", self.rank, self.size, self.device,
                 self.backend)

    def _wait_for_ranks(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT.total_seconds()
        waiting = set(range(1, self.size))
        while waiting:
            for r in sorted(waiting):
                if self.store.check([failed(r)]):
                    raise RuntimeError(f"tensor-parallel rank {r} failed to start: "
                                       f"{self.store.get(failed(r)).decode()}")
                if self.store.check([_loaded(r)]):
                    waiting.discard(r)
            for r, p in enumerate(self.workers, 1):
                if r in waiting and p.poll() is not None:
                    raise RuntimeError(f"tensor-parallel rank {r} exited with {p.returncode} "
                                       "while loading (its log is above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks {sorted(waiting)} did not load the model "
                                   f"within {START_TIMEOUT}")
            time.sleep(0.05)

    def close(self) -> None:
        """Stop the other ranks (rank 0) and leave the process group."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            if self.rank == 0 and self._connected and self.broken is None:
                try:
                    self._broadcast_header([_STOP] + [0] * (_HEADER - 1))
                except RuntimeError as exc:
                    log.warning("tensor-parallel stop not delivered: %s", exc)
        for p in self.workers:
            if not self._connected and p.poll() is None:
                p.terminate()   # rank 0 failed before the group formed: nothing to wait for
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self._connected and dist.is_initialized():
            dist.destroy_process_group()
        self._connected = False

    # -- collectives the model calls ----------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``x`` (in place)."""
        dist.all_reduce(x)
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """This rank's logits [R, its vocabulary] → on rank 0 the whole
        [R, V] (None elsewhere)."""
        split = self.split
        if logits.shape[1] == split.vocab_piece and logits.device == self._wire:
            piece = logits.contiguous()   # an even split: sent as it is
        else:   # padded to the largest slice (gather takes equal shapes)
            piece = logits.new_zeros(logits.shape[0], split.vocab_piece, device=self._wire)
            piece[:, :logits.shape[1]] = logits
        if self.rank != 0:
            dist.gather(piece, dst=0)
            return None
        pieces = [torch.empty_like(piece) for _ in range(self.size)]
        dist.gather(piece, pieces, dst=0)
        sizes = [len(_even(split.vocab_size, self.size, r)) for r in range(self.size)]
        return torch.cat([p[:, :n] for p, n in zip(pieces, sizes)], dim=1).to(logits.device)

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's ``value`` (the KV block count they can all hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=self._wire)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    # -- the step -------------------------------------------------------------

    @contextmanager
    def step(self, plan):
        """Around one forward pass: rank 0 first sends the step's arrays. A
        failure inside leaves the ranks out of step, so the group is marked
        broken and every later step fails at once."""
        with self._lock:
            if self.broken is not None:
                raise RuntimeError(f"the tensor-parallel group is broken ({self.broken}); "
                                   "restart the engine")
            start = time.monotonic()
            try:
                if self.rank == 0:
                    self._send_step(plan)
                yield
            except BaseException as exc:
                self.broken = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                self._last = time.monotonic()
                self.steps += 1
                self.forward_seconds += self._last - start
        if self.rank != 0 and self._last - self._reported >= STATS_SECONDS:
            self._reported = self._last
            with self._store_lock:
                self.store.set(_stats(self.rank), f"{self.steps} {self.forward_seconds}")

    def rank_stats(self) -> list[tuple[int, int, float]]:
        """(rank, steps, forward seconds) of every rank, as each last reported
        (the other ranks every STATS_SECONDS; a rank not heard from yet is left out)."""
        out = [(0, self.steps, self.forward_seconds)]
        with self._store_lock:
            for r in range(1, self.size):
                if self.store.check([_stats(r)]):
                    steps, seconds = self.store.get(_stats(r)).decode().split()
                    out.append((r, int(steps), float(seconds)))
        return out

    def _send_step(self, plan) -> None:
        tables = plan.block_tables
        header = [_STEP, len(plan.input_ids), tables.shape[0], tables.shape[1],
                  len(plan.logits_indices), plan.max_query_len, plan.max_context_len,
                  int(plan.is_decode_only)]
        self._broadcast_header(header)
        payload = np.concatenate([plan.input_ids, plan.positions, plan.slot_mapping,
                                  tables.reshape(-1), plan.context_lens, plan.query_start_loc,
                                  plan.logits_indices], dtype=np.int64)
        dist.broadcast(torch.from_numpy(payload).to(self._wire), src=0)

    def receive_step(self) -> StepArrays | None:
        """On ranks other than 0: the next step's arrays, None when rank 0 stops."""
        while True:
            header = torch.empty(_HEADER, dtype=torch.int64, device=self._wire)
            dist.broadcast(header, src=0)
            command, t, b, m, r, max_q, max_ctx, decode = header.tolist()
            if command == _STOP:
                return None
            if command == _STEP:
                break
        payload = torch.empty(3 * t + b * m + b + (b + 1) + r, dtype=torch.int64, device=self._wire)
        dist.broadcast(payload, src=0)
        ids, pos, slots, tables, lens, starts, rows = np.split(
            payload.cpu().numpy(), np.cumsum([t, t, t, b * m, b, b + 1]))
        return StepArrays(ids, pos, slots, tables.reshape(b, m).astype(np.int32),
                          lens.astype(np.int32), starts.astype(np.int32), rows,
                          max_q, max_ctx, bool(decode))

    def _broadcast_header(self, values: list[int]) -> None:
        dist.broadcast(torch.tensor(values, dtype=torch.int64, device=self._wire), src=0)

    def _heartbeat(self) -> None:
        """Rank 0, while idle: a beat now and then, so the other ranks' wait
        for the next step never reaches the collective timeout."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while not self._closed and self.broken is None:
            time.sleep(HEARTBEAT_SECONDS / 3)
            self.beat_if_idle(HEARTBEAT_SECONDS)

    def beat_if_idle(self, idle_seconds: float) -> None:
        """Rank 0: send a beat if no step ran for ``idle_seconds``."""
        with self._lock:
            if self._closed or self.broken is not None or \
                    time.monotonic() - self._last < idle_seconds:
                return
            try:
                self._broadcast_header([_BEAT] + [0] * (_HEADER - 1))
            except RuntimeError as exc:
                self.broken = f"heartbeat: {exc}"
                log.error("tensor-parallel group broken: %s", exc)
            self._last = time.monotonic()


# -- starting the ranks -------------------------------------------------------

def launched_rank() -> int | None:
    """This process's RANK when it was started for env:// rendezvous
    (torchrun or by hand), else None."""
    return int(os.environ["RANK"]) if "WORLD_SIZE" in os.environ and "RANK" in os.environ else None


@dataclass(frozen=True)
class RankSetup:
    """What every rank loads and how it sizes its KV cache: rank 0 says it
    (through the store) and the others build their model runner from it."""

    model: str                    # the model file or directory
    device: str
    dtype: str | None             # a torch dtype's name ("bfloat16"), or None for the default
    block_size: int
    kv_cache_tokens: int | None
    max_num_seqs: int
    max_model_len: int            # within the model's positions


def rank_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return dev


def start(size: int, setup: RankSetup) -> TensorGroup:
    """On rank 0: a group of ``size`` ranks. Under env:// rendezvous
    (WORLD_SIZE set) the other ranks were started by the launcher; otherwise
    they are started here, one process each on this host. ``setup`` (what to
    load, the KV cache's sizes) reaches them through the store. The group is
    not connected yet: load this rank's part, then ``connect()``."""
    if launched_rank() is not None:
        world, rank = int(os.environ["WORLD_SIZE"]), launched_rank()
        if world != size:
            raise ValueError(f"WORLD_SIZE={world} is not tensor_parallel_size={size}: every rank "
                             "of the group is one process")
        if rank != 0:
            raise ValueError(f"this process is rank {rank}: only rank 0 runs the engine; run the "
                             "others with `python -m guided.model.worker`")
        host, port, workers, threads = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), [], None
    else:
        host, port = "127.0.0.1", free_port()
        threads = max(1, torch.get_num_threads() // size)   # this process's share (OMP_NUM_THREADS)
        workers = None
    if dist.is_initialized():
        raise RuntimeError("this process already has a torch.distributed group (a tensor-parallel "
                           "LLM not closed?): one per process; close() the other first")
    store = dist.TCPStore(host, port, size, is_master=True, wait_for_workers=False,
                          timeout=START_TIMEOUT)
    store.set(SETUP_KEY, json.dumps(asdict(setup)))
    if workers is None:
        env = dict(os.environ, MASTER_ADDR=host, MASTER_PORT=str(port), WORLD_SIZE=str(size),
                   GUIDED_TP_THREADS=str(threads))
        workers = [subprocess.Popen([sys.executable, "-m", "guided.model.worker"],
                                    env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                    preexec_fn=die_with_parent) for r in range(1, size)]
        log.info("started tensor-parallel ranks 1..%d on this host (%d torch threads each)",
                 size - 1, threads)
    return TensorGroup(0, size, rank_device(setup.device), store, workers, threads)
