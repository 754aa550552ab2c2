"""The tensor-parallel process group: the collectives the model calls, the
step's arrays broadcast from rank 0, the heartbeat of an idle rank 0, and
rank 0's watch over the other ranks while they load."""
from __future__ import annotations

import atexit
import logging
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from .split import TensorSplit

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


def failed(rank: int) -> str:
    """The store key where a rank that could not load says why."""
    return f"guided/failed/{rank}"


def _loaded(rank: int) -> str:
    return f"guided/loaded/{rank}"


def _stats(rank: int) -> str:
    return f"guided/stats/{rank}"


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
        return torch.cat([p[:, :n] for p, n in zip(pieces, split.vocab_sizes)],
                         dim=1).to(logits.device)

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
