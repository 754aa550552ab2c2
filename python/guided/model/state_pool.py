"""The recurrent states of Mamba-2 and Gated DeltaNet layers (mamba.py,
delta_net.py): a slot per running sequence, and snapshots that let the prefix
cache serve a later request.

A sequence takes a slot at its first step and gives it back when the engine
ends it (``release``). A step whose rows start a sequence at position 0
starts from zeros (a new request, or a preempted one recomputing); any other
step must start where the slot's state is, or where a snapshot the request
was promised puts it; anything else fails by name rather than read another
position's state.

Snapshots. A state is a function of the whole prefix, so a prefix-cache hit
can only be taken where the state at the hit's end is known. While a
sequence runs, its state is copied at two block boundaries: the last one
within its prompt, and the last one it has computed. When it ends, both are
kept, keyed by the hash chain of the tokens before them (LRU, as many as
there are slots). A new request's prompt is looked up there (``hit``): the
longest kept boundary is the only prefix-cache hit the scheduler may give it
(``Scheduler.limit_prefix``), and its first step starts from that snapshot.
So an agent's next turn, whose prompt is the previous prompt and answer
and more, prefills from the block boundary before the answer's end; a
repeated prompt from the boundary before its last token.
"""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np
import torch


log = logging.getLogger("guided.model")


@dataclass
class StateStep:
    """A step's sequences as the recurrence reads them: each one's state slot, first row,
    row count, whether it starts from zeros, and the row (within its rows; -1: none) after
    which its state is copied to the slot's end and prompt boundary buffers."""
    slots: torch.Tensor    # [B] int64
    starts: torch.Tensor   # [B] int64
    counts: torch.Tensor   # [B] int64
    fresh: torch.Tensor    # [B] bool
    capture_end: torch.Tensor      # [B] int64
    capture_prompt: torch.Tensor   # [B] int64
    pool: "StatePool"


class StatePool:
    """[layers, slots, *shape] float32 states (`shape`: one layer's state of one sequence), their
    boundary copies, and the snapshots kept for the prefix cache."""

    def __init__(self, shape: tuple[int, ...], layers: int, slots: int, device, block_size: int):
        self.layers, self.device, self.block_size = layers, device, block_size
        shape = (layers, slots, *shape)
        self.states, self.at_end, self.at_prompt = (torch.zeros(shape, device=device) for _ in range(3))
        #: per slot: the position its state has reached (-1: none), and the boundaries its copies are at
        self.reached, self.end_at, self.prompt_at = (np.zeros(slots, dtype=np.int64) for _ in range(3))
        self.reached[:] = -1
        self.slot_of: dict[int, int] = {}
        self.free = list(range(slots - 1, -1, -1))
        self.capacity = slots
        self.snapshots: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.pins: Counter[int] = Counter()
        #: per live request: its prompt's last boundary, and the snapshot it was promised (position, key)
        self.prompt_boundary: dict[int, int] = {}
        self.promised: dict[int, tuple[int, int]] = {}

    @property
    def bytes_per_sequence(self) -> int:
        return self.states[:, 0].numel() * self.states.element_size()

    # -- requests -------------------------------------------------------------------------

    def hit(self, seq_id: int, prompt: list[int]) -> int:
        """The longest block boundary of `prompt` (before its last token) with a snapshot, pinned
        for `seq_id` until it ends: the prefix-cache hit it may have (0: none)."""
        blocks = (len(prompt) - 1) // self.block_size
        self.prompt_boundary[seq_id] = blocks * self.block_size
        keys = self._keys(prompt, blocks)
        for j in range(blocks, 0, -1):
            if keys[j - 1] in self.snapshots:
                self.snapshots.move_to_end(keys[j - 1])
                self.pins[keys[j - 1]] += 1
                self.promised[seq_id] = (j * self.block_size, keys[j - 1])
                return j * self.block_size
        return 0

    def release(self, seq_id: int, tokens: list[int] | None = None) -> None:
        """`seq_id` ended: its slot back, and (given its tokens) its boundary copies kept as snapshots."""
        self.prompt_boundary.pop(seq_id, None)
        if (promised := self.promised.pop(seq_id, None)) is not None:
            self.pins[promised[1]] -= 1
        slot = self.slot_of.pop(seq_id, None)
        if slot is None:
            return
        if tokens is not None:
            for at, copy in ((self.end_at[slot], self.at_end), (self.prompt_at[slot], self.at_prompt)):
                if 0 < at <= len(tokens):
                    self._keep(self._keys(tokens, int(at) // self.block_size)[-1], copy[:, slot].clone())
        self.end_at[slot] = self.prompt_at[slot] = 0
        self.reached[slot] = -1   # no position: the next owner starts at 0 or from a snapshot
        self.free.append(slot)

    # -- steps ----------------------------------------------------------------------------

    def step(self, plan) -> StateStep:
        """The slots of `plan`'s sequences (taken where new, restored where promised), checked
        against their positions, and the rows whose states are copied."""
        starts = plan.query_start_loc[:-1].astype(np.int64)
        counts = np.diff(plan.query_start_loc).astype(np.int64)
        first = plan.positions[starts].astype(np.int64)
        ids = [int(s) for s in plan.seq_ids]
        slots = np.array([self._slot(s) for s in ids], dtype=np.int64)
        restored = np.zeros(len(ids), dtype=bool)
        for i in np.flatnonzero((first != 0) & (self.reached[slots] != first)):
            at, key = self.promised.get(ids[i], (None, None))
            if at != first[i]:
                raise RuntimeError(f"sequence {ids[i]}'s recurrent state is at position "
                                   f"{int(self.reached[slots[i]])}, its step starts at {int(first[i])}")
            self.states[:, slots[i]] = self.snapshots[key]
            restored[i] = True
        end = first + counts
        self.reached[slots] = end
        boundary = end // self.block_size * self.block_size
        capture_end = np.where(boundary > first, boundary - first - 1, -1)
        restart = (first == 0) | restored
        self.end_at[slots] = np.where(capture_end >= 0, boundary, np.where(restart, 0, self.end_at[slots]))
        prompt = np.array([self.prompt_boundary.get(s, 0) for s in ids], dtype=np.int64)
        capture_prompt = np.where((first < prompt) & (prompt <= end), prompt - first - 1, -1)
        self.prompt_at[slots] = np.where(capture_prompt >= 0, prompt, np.where(restart, 0, self.prompt_at[slots]))
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        return StateStep(t(slots), t(starts), t(counts), t(first == 0), t(capture_end), t(capture_prompt), self)

    def carry(self, layer: int, s: StateStep, update) -> None:
        """Carry the step's sequences' states of recurrent layer `layer` through their rows,
        sequences side by side: `update(rows, states)` takes the k-th rows of the sequences that
        have one and their states, and returns the states after them. The states at the block
        boundaries the step captures are copied for the snapshots."""
        pool = self.states[layer]
        state = pool.index_select(0, s.slots) * (~s.fresh).view(-1, *(1,) * (pool.dim() - 1))
        for k in range(int(s.counts.max())):
            live = (s.counts > k).nonzero().squeeze(1)
            state[live] = after = update(s.starts[live] + k, state[live])
            for capture, copies in ((s.capture_end, self.at_end), (s.capture_prompt, self.at_prompt)):
                hit = capture[live] == k
                if hit.any():
                    copies[layer].index_copy_(0, s.slots[live][hit], after[hit])
        pool.index_copy_(0, s.slots, state)

    # -- internals ------------------------------------------------------------------------

    def _slot(self, seq_id: int) -> int:
        if seq_id in self.slot_of:
            return self.slot_of[seq_id]
        if not self.free:   # preempted sequences hold theirs: one more
            n = self.states.shape[1]
            log.info("recurrent state pool: %d slots are held; adding one", n)
            self.states, self.at_end, self.at_prompt = (torch.cat([t, torch.zeros_like(t[:, :1])], dim=1)
                                                        for t in (self.states, self.at_end, self.at_prompt))
            self.reached, self.end_at, self.prompt_at = (np.append(a, v) for a, v in
                                                         ((self.reached, -1), (self.end_at, 0), (self.prompt_at, 0)))
            self.free.append(n)
        self.slot_of[seq_id] = slot = self.free.pop()
        return slot

    def _keys(self, tokens: list[int], blocks: int) -> list[int]:
        """The hash chain of `tokens`' first `blocks` blocks: key j stands for all tokens before block j + 1."""
        keys, h, bs = [], 0, self.block_size
        for j in range(blocks):
            h = hash((h, tuple(tokens[j * bs:(j + 1) * bs])))
            keys.append(h)
        return keys

    def _keep(self, key: int, state: torch.Tensor) -> None:
        self.snapshots[key] = state
        self.snapshots.move_to_end(key)
        for old in [k for k in self.snapshots if not self.pins[k]][:max(0, len(self.snapshots) - self.capacity)]:
            del self.snapshots[old]
