"""The recurrent states of Mamba-2 and Gated DeltaNet layers (mamba.py,
delta_net.py): a slot per running sequence, and snapshots that let the prefix
cache serve a later request.

Blocks. A sequence's positions fall in the KV cache's blocks, and its state is
known at their boundaries: a slot holds the state at the last block boundary a
sequence has passed, and each step computes a block it touches whole, from that
state and the block's tokens, which the paged cache keeps per token (the
convolution's inputs, and the mixer's per-token gates: dt, or b and a). A
block is one chunk of the chunked forms (Mamba-2's SSD, the chunked gated
delta rule), of one shape always, its tokens past the ones computed so far
masked out; a row's output is that block's row, however the rows came: in one
prefill, chunk by chunk, token by token while decoding, alone or batched,
with or without a prefix-cache hit. So a row's numbers are the same in every
case (the invariance the attention layers have), and a prefill has no
token-by-token loop.

A sequence takes a slot at its first step and gives it back when the engine
ends it (``release``). A step whose rows start a sequence at position 0
starts from zeros (a new request, or a preempted one recomputing); any other
step must start in the block the slot's state opens, or where a snapshot the
request was promised puts it; anything else fails by name rather than read
another position's state.

Snapshots. A state is a function of the whole prefix, so a prefix-cache hit
can only be taken where the state at the hit's end is known. A sequence's
state at the last block boundary within its prompt is copied when its step
passes it; when it ends, that copy and the slot's own state (at the last
boundary it computed) are kept, keyed by the hash chain of the tokens before
them (LRU, as many as there are slots). A new request's prompt is looked up
there (``hit``): the longest kept boundary is the only prefix-cache hit the
scheduler may give it (``Scheduler.limit_prefix``), and its first step starts
from that snapshot. So an agent's next turn, whose prompt is the previous
prompt and answer and more, prefills from the block boundary before the
answer's end; a repeated prompt from the boundary before its last token.

Branch points. Requests that share a prefix and then part (one system prompt,
different questions; one conversation, different next turns) have no
snapshot where they part: neither request's own boundaries lie there. So the
block keys of every request's tokens are remembered (``seen``), and a prompt
that goes on past its snapshot along an earlier request's tokens has its state
copied where it parts from them (SGLang's branch-point caching, vLLM's
shared-prefix checkpoint): the second request of a system prompt computes it,
the third and later start from there.

Drafts. A step that checks a token and its drafts may pass a block boundary
with tokens the check then refuses: where it passes one, the slot's state from
before the step is kept (``drafted``), and the next step goes back to it.
"""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np
import torch


log = logging.getLogger("guided.model")

#: how many block keys of past requests' tokens are remembered to find where a new one parts from them
SEEN_BLOCKS = 1 << 16


def segment_decay(cum: torch.Tensor) -> torch.Tensor:
    """exp(Λ_t − Λ_s) for s ≤ t and 0 above the diagonal, [n, H, t, s], from a block's
    cumulative log decays Λ [n, L, H] (the chunked scans' weights, mamba.py and delta_net.py)."""
    lam = cum.transpose(1, 2)
    diff = lam[..., :, None] - lam[..., None, :]
    causal = torch.ones(diff.shape[-1], diff.shape[-1], dtype=torch.bool, device=cum.device).tril()
    return torch.where(causal, diff, float("-inf")).exp()


@dataclass
class Segment:
    """One round of a step's scan: the k-th block each sequence touches (those that touch k)."""
    live: torch.Tensor      # [n] int64: the sequences (indices into the step's)
    window: torch.Tensor    # [n, conv_kernel - 1 + block] int64: the cache slots of the block's positions
                            # and the kernel − 1 before them (-1: before the sequence)
    valid: torch.Tensor     # [n, block] bool: the positions computed so far (this step's included)
    rows: torch.Tensor      # [n, block] int64: the step's row of each position it computes (-1: none)
    complete: torch.Tensor  # [n] bool: the block is whole: the state at its end is the slot's next
    whole: bool             # any of the round's blocks is whole (else no state changes this round)
    #: per copy of a state at a block's end made this round: (indices into `live`, destination
    #: [layers, m, *shape], indices into the destination's second dimension)
    captures: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class StateStep:
    """A step's sequences as the recurrence reads them: each one's state slot, whether it starts
    from zeros, and the rounds of blocks the scan carries the states through."""
    slots: torch.Tensor     # [B] int64
    fresh: torch.Tensor     # [B] bool
    segments: list[Segment]
    rows: int               # the step's rows
    pool: "StatePool"


class StatePool:
    """[layers, slots, *shape] float32 states (`shape`: one layer's state of one sequence), the
    copies at prompt boundaries, and the snapshots kept for the prefix cache. `conv_kernel`: the
    mixers' convolution width (a block's computation reads the kernel − 1 positions before it)."""

    def __init__(self, shape: tuple[int, ...], layers: int, slots: int, device, block_size: int,
                 conv_kernel: int = 1):
        self.layers, self.device, self.block_size, self.conv_kernel = layers, device, block_size, conv_kernel
        shape = (layers, slots, *shape)
        self.states, self.at_prompt = (torch.zeros(shape, device=device) for _ in range(2))
        #: per slot: the position its sequence has computed to (-1: none), and the boundary its
        #: prompt copy is at (0: none)
        self.reached, self.prompt_at = np.zeros(slots, dtype=np.int64), np.zeros(slots, dtype=np.int64)
        self.reached[:] = -1
        #: per slot: the block boundary its state is at (-1: none)
        self.state_at = np.full(slots, -1, dtype=np.int64)
        self.slot_of: dict[int, int] = {}
        self.free = list(range(slots - 1, -1, -1))
        self.capacity = slots
        self.snapshots: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.pins: Counter[int] = Counter()
        #: per live request: its prompt's last boundary, and the snapshot it was promised (position, key)
        self.prompt_boundary: dict[int, int] = {}
        self.promised: dict[int, tuple[int, int]] = {}
        #: the block keys requests' tokens have gone through (LRU), to find where a new one parts
        #: from them; per live request, that point, and where its state there was copied
        self.seen: OrderedDict[int, None] = OrderedDict()
        self.branch_at: dict[int, int] = {}
        self.branch_copies: dict[int, tuple[int, torch.Tensor, int]] = {}
        #: per sequence whose last step checked drafts: its slot's state before that step and
        #: the boundary it was at
        self.drafted: dict[int, tuple[int, torch.Tensor]] = {}

    @property
    def bytes_per_sequence(self) -> int:
        return self.states[:, 0].numel() * self.states.element_size()

    # -- requests -------------------------------------------------------------------------

    def hit(self, seq_id: int, prompt: list[int]) -> int:
        """The longest block boundary of `prompt` (before its last token) with a snapshot, pinned
        for `seq_id` until it ends: the prefix-cache hit it may have (0: none). Where `prompt`
        goes on past that along an earlier request's tokens, the boundary where it parts from
        them is marked: its state there is copied on the way, for the requests after it."""
        blocks = (len(prompt) - 1) // self.block_size
        self.prompt_boundary[seq_id] = blocks * self.block_size
        keys = self._keys(prompt, blocks)
        found = next((j for j in range(blocks, 0, -1) if keys[j - 1] in self.snapshots), 0)
        parted = next((j for j in range(blocks, found, -1) if keys[j - 1] in self.seen), 0)
        if found < parted < blocks:   # (at `blocks` the prompt's own copy is taken)
            self.branch_at[seq_id] = parted * self.block_size
        self._see(keys)
        if not found:
            return 0
        self.snapshots.move_to_end(keys[found - 1])
        self.pins[keys[found - 1]] += 1
        self.promised[seq_id] = (found * self.block_size, keys[found - 1])
        return found * self.block_size

    def release(self, seq_id: int, tokens: list[int] | None = None) -> None:
        """`seq_id` ended: its slot back, and (given its tokens) its states at boundaries kept as
        snapshots and its tokens' blocks remembered."""
        self.prompt_boundary.pop(seq_id, None)
        self.branch_at.pop(seq_id, None)
        drafted = self.drafted.pop(seq_id, None)
        branch = self.branch_copies.pop(seq_id, None)
        if (promised := self.promised.pop(seq_id, None)) is not None:
            self.pins[promised[1]] -= 1
        slot = self.slot_of.pop(seq_id, None)
        if slot is None:
            return
        if tokens is not None:
            bs = self.block_size
            kept = [(self.prompt_at[slot], self.at_prompt[:, slot])]
            boundary = self.state_at[slot]
            if drafted is not None and drafted[0] < boundary:
                kept.append(drafted)   # its last step's drafts passed a boundary: the state before them
            else:
                kept.append((boundary, self.states[:, slot]))
            if branch is not None:
                kept.append((branch[0], branch[1][:, branch[2]]))
            keys = self._keys(tokens, len(tokens) // bs)
            self._see(keys)
            for at, copy in kept:
                if 0 < at <= len(tokens):
                    self._keep(keys[int(at) // bs - 1], copy.clone())
        self.prompt_at[slot] = 0
        self.reached[slot] = self.state_at[slot] = -1   # the next owner starts at 0 or from a snapshot
        self.free.append(slot)

    # -- steps ----------------------------------------------------------------------------

    def step(self, plan) -> StateStep:
        """The slots of `plan`'s sequences (taken where new, restored where promised or where
        drafts were refused), checked against their positions, and the blocks the scan computes."""
        bs = self.block_size
        starts = plan.query_start_loc[:-1].astype(np.int64)
        counts = np.diff(plan.query_start_loc).astype(np.int64)
        first = plan.positions[starts].astype(np.int64)
        ids = [int(s) for s in plan.seq_ids]
        slots = np.array([self._slot(s) for s in ids], dtype=np.int64)
        drafted = {s: self.drafted.pop(s) for s in ids if s in self.drafted}
        fresh = first == 0
        restored = np.zeros(len(ids), dtype=bool)
        for i in np.flatnonzero(~fresh):
            slot, reached = slots[i], self.reached[slots[i]]
            if 0 <= self.state_at[slot] <= first[i] <= reached:
                continue   # the positions from the state's boundary to the step are in the cache
            at, key = self.promised.get(ids[i], (None, None))
            if at == first[i]:
                self.states[:, slot], self.state_at[slot] = self.snapshots[key], at
                restored[i] = True
            elif (copy := drafted.get(ids[i])) is not None and copy[0] <= first[i] <= reached:
                # refused drafts had passed a boundary: back to the state before them
                self.states[:, slot], self.state_at[slot] = copy[1], copy[0]
            else:
                raise RuntimeError(f"sequence {ids[i]}'s recurrent state is at position "
                                   f"{int(reached)}, its step starts at {int(first[i])}")
        self.state_at[slots[fresh]] = 0
        origin = self.state_at[slots].copy()
        end = first + counts
        sampled = Counter(np.asarray(plan.sample_seq_ids).tolist())
        for i, s in enumerate(ids):
            # a token and its drafts passing a boundary: the state before them, for a refusal (one
            # that passes none leaves the slot's state as it is)
            if sampled.get(s, 0) > 1 and end[i] // bs * bs > origin[i]:
                self.drafted[s] = (int(origin[i]), self.states[:, slots[i]].clone())
        self.reached[slots] = end
        self.state_at[slots] = end // bs * bs
        prompt = np.array([self.prompt_boundary.get(s, 0) for s in ids], dtype=np.int64)
        self.prompt_at[slots] = np.where(fresh | restored, 0, self.prompt_at[slots])
        copies = [(prompt, self.at_prompt, slots), self._branch_copies(ids, first, end)]
        for i in np.flatnonzero((first < prompt) & (prompt <= end)):
            self.prompt_at[slots[i]] = prompt[i]
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        tables = np.asarray(plan.block_tables).reshape(len(ids), -1)
        return StateStep(t(slots), t(fresh), self._segments(tables, starts, origin, first, end, copies, t),
                         int(counts.sum()), self)

    def carry(self, layer: int, s: StateStep, update) -> None:
        """Carry the step's sequences' states of recurrent layer `layer` through the blocks they
        touch, a round at a time: `update(segment, states)` computes the rows of the round's
        blocks from the states at their starts and returns the states at their ends (kept where
        a block is whole). The states at the boundaries the step copies are copied."""
        pool = self.states[layer]
        state = pool.index_select(0, s.slots) * (~s.fresh).view(-1, *(1,) * (pool.dim() - 1))
        for seg in s.segments:
            before = state[seg.live]
            after = update(seg, before)
            state[seg.live] = torch.where(seg.complete.view(-1, *(1,) * (pool.dim() - 1)), after, before)
            for which, copies, index in seg.captures:
                copies[layer].index_copy_(0, index, after[which])
        pool.index_copy_(0, s.slots, state)

    def _branch_copies(self, ids: list[int], first: np.ndarray, end: np.ndarray):
        """Where sequences pass the point at which they part from an earlier request (``hit``),
        and a copy of [layers, n, *shape] for those states."""
        at = np.array([self.branch_at.get(s, 0) for s in ids], dtype=np.int64)
        passing = np.flatnonzero((first < at) & (at <= end))
        copies = torch.empty((self.layers, len(passing), *self.states.shape[2:]), device=self.device) \
            if passing.size else None
        index, where = np.zeros(len(ids), dtype=np.int64), np.zeros(len(ids), dtype=np.int64)
        for j, i in enumerate(passing):
            self.branch_copies[ids[i]] = (int(at[i]), copies, j)
            index[i], where[i] = j, at[i]
        return where, copies, index

    def _segments(self, tables, starts, origin, first, end, copies, t) -> list[Segment]:
        """The rounds of blocks the step's sequences touch (Segment): sequence i's k-th round is
        the k-th block from the boundary its state is at (`origin`: the block holding its first
        row, or an earlier one after refused drafts)."""
        bs, back = self.block_size, self.conv_kernel - 1
        opens = [np.arange(o, e, bs) for o, e in zip(origin, end)]
        out = []
        for k in range(max(len(o) for o in opens)):
            live = np.array([i for i, o in enumerate(opens) if len(o) > k], dtype=np.int64)
            block = np.array([opens[i][k] for i in live], dtype=np.int64)
            positions = block[:, None] + np.arange(-back, bs)[None]                      # [n, back + bs]
            kept = positions.clip(min=0)
            window = tables[live[:, None], kept // bs] * bs + kept % bs
            window = np.where(positions >= 0, window, -1)
            mine = positions[:, back:]
            valid = mine < end[live][:, None]
            rows = np.where(valid & (mine >= first[live][:, None]),
                            starts[live][:, None] + mine - first[live][:, None], -1)
            closes = block + bs
            captures = []
            for at, dest, index in copies:
                hit = np.flatnonzero((at[live] == closes) & (closes <= end[live]))
                if hit.size and dest is not None:
                    captures.append((t(hit), dest, t(index[live[hit]])))
            whole = closes <= end[live]
            out.append(Segment(t(live), t(window), t(valid), t(rows), t(whole), bool(whole.any()), captures))
        return out

    # -- internals ------------------------------------------------------------------------

    def _slot(self, seq_id: int) -> int:
        if seq_id in self.slot_of:
            return self.slot_of[seq_id]
        if not self.free:   # preempted sequences hold theirs: one more
            n = self.states.shape[1]
            log.info("recurrent state pool: %d slots are held; adding one", n)
            self.states, self.at_prompt = (torch.cat([t, torch.zeros_like(t[:, :1])], dim=1)
                                           for t in (self.states, self.at_prompt))
            self.reached, self.prompt_at = np.append(self.reached, -1), np.append(self.prompt_at, 0)
            self.state_at = np.append(self.state_at, -1)
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

    def _see(self, keys: list[int]) -> None:
        for key in keys:
            self.seen[key] = None
            self.seen.move_to_end(key)
        while len(self.seen) > SEEN_BLOCKS:
            self.seen.popitem(last=False)

    def _keep(self, key: int, state: torch.Tensor) -> None:
        self.snapshots[key] = state
        self.snapshots.move_to_end(key)
        for old in [k for k in self.snapshots if not self.pins[k]][:max(0, len(self.snapshots) - self.capacity)]:
            del self.snapshots[old]
