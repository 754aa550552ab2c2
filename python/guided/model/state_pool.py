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

Branch points. Requests that share a prefix and then part (one system prompt,
different questions; one conversation, different next turns) have no
snapshot where they part: neither request's own boundaries lie there. So the
block keys of every request's tokens are remembered (``seen``), and a prompt
that goes on past its snapshot along an earlier request's tokens has its state
copied where it parts from them (SGLang's branch-point caching, vLLM's
shared-prefix checkpoint): the second request of a system prompt computes it,
the third and later start from there.

Steps. The scan carries the states a segment at a time (``Segment``): a
sequence's rows are cut at every multiple of SCAN_CHUNK positions and after
each row whose state is copied, so the cuts do not depend on the batch the
rows came in.
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
#: the scan's segments end at multiples of this many positions (and where a state is copied)
SCAN_CHUNK = 64


def segment_decay(cum: torch.Tensor) -> torch.Tensor:
    """exp(Λ_t − Λ_s) for s ≤ t and 0 above the diagonal, [n, H, t, s], from a segment's
    cumulative log decays Λ [n, L, H] (the chunked scans' weights, mamba.py and delta_net.py)."""
    lam = cum.transpose(1, 2)
    diff = lam[..., :, None] - lam[..., None, :]
    causal = torch.ones(diff.shape[-1], diff.shape[-1], dtype=torch.bool, device=cum.device).tril()
    return torch.where(causal, diff, float("-inf")).exp()


@dataclass
class Segment:
    """One round of a step's scan: the k-th segment of each sequence that has one, each
    scanned as one chunk (StatePool._segments says where a sequence's rows are cut)."""
    live: torch.Tensor     # [b] int64: the sequences (indices into the step's) that have a k-th segment
    rows: torch.Tensor     # [b, L] int64: their rows, each padded with its segment's last row
    valid: torch.Tensor    # [b, L] bool: which of `rows` are the segment's (the others are padding)
    #: per boundary copy made after this segment: (indices into `live`, destination [layers, n, *shape],
    #: indices into the destination's second dimension)
    captures: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class StateStep:
    """A step's sequences as the recurrence reads them: each one's state slot, first row,
    row count, whether it starts from zeros, and the row (within its rows; -1: none) after
    which its state is copied to the slot's end and prompt boundary buffers; the rounds of
    segments the scan carries the states through."""
    slots: torch.Tensor    # [B] int64
    starts: torch.Tensor   # [B] int64
    counts: torch.Tensor   # [B] int64
    fresh: torch.Tensor    # [B] bool
    capture_end: torch.Tensor      # [B] int64
    capture_prompt: torch.Tensor   # [B] int64
    segments: list[Segment]
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
        #: the block keys requests' tokens have gone through (LRU), to find where a new one parts
        #: from them; per live request, that point, and where its state there was copied
        self.seen: OrderedDict[int, None] = OrderedDict()
        self.branch_at: dict[int, int] = {}
        self.branch_copies: dict[int, tuple[int, torch.Tensor, int]] = {}
        #: per sequence sampled at several rows in the last step (drafts checked): the states after
        #: each of those rows but the last, by the position they reach
        self.drafted: dict[int, dict[int, tuple[torch.Tensor, int]]] = {}

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
        """`seq_id` ended: its slot back, and (given its tokens) its boundary copies kept as snapshots
        and its tokens' blocks remembered."""
        self.prompt_boundary.pop(seq_id, None)
        self.branch_at.pop(seq_id, None)
        self.drafted.pop(seq_id, None)
        branch = self.branch_copies.pop(seq_id, None)
        if (promised := self.promised.pop(seq_id, None)) is not None:
            self.pins[promised[1]] -= 1
        slot = self.slot_of.pop(seq_id, None)
        if slot is None:
            return
        if tokens is not None:
            kept = [(self.end_at[slot], self.at_end[:, slot]), (self.prompt_at[slot], self.at_prompt[:, slot])]
            if branch is not None:
                kept.append((branch[0], branch[1][:, branch[2]]))
            keys = self._keys(tokens, len(tokens) // self.block_size)
            self._see(keys)
            for at, copy in kept:
                if 0 < at <= len(tokens):
                    self._keep(keys[int(at) // self.block_size - 1], copy.clone())
        self.end_at[slot] = self.prompt_at[slot] = 0
        self.reached[slot] = -1   # no position: the next owner starts at 0 or from a snapshot
        self.free.append(slot)

    # -- steps ----------------------------------------------------------------------------

    def step(self, plan) -> StateStep:
        """The slots of `plan`'s sequences (taken where new, restored where promised), checked
        against their positions, the rows whose states are copied, and the scan's segments."""
        starts = plan.query_start_loc[:-1].astype(np.int64)
        counts = np.diff(plan.query_start_loc).astype(np.int64)
        first = plan.positions[starts].astype(np.int64)
        ids = [int(s) for s in plan.seq_ids]
        slots = np.array([self._slot(s) for s in ids], dtype=np.int64)
        restored = np.zeros(len(ids), dtype=bool)
        drafted = {s: self.drafted.pop(s) for s in ids if s in self.drafted}
        for i in np.flatnonzero((first != 0) & (self.reached[slots] != first)):
            at, key = self.promised.get(ids[i], (None, None))
            if (copy := drafted.get(ids[i], {}).get(int(first[i]))) is not None:
                # some of its drafts were refused: back to the state after the last one kept
                self.states[:, slots[i]] = copy[0][:, copy[1]]
                if self.end_at[slots[i]] > first[i]:   # a copy past the refused tokens
                    self.end_at[slots[i]] = 0
                continue
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
        captures = [(capture_end, self.at_end, slots), (capture_prompt, self.at_prompt, slots),
                    self._branch_captures(ids, first, end), *self._draft_captures(plan, ids, first, counts)]
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        return StateStep(t(slots), t(starts), t(counts), t(first == 0), t(capture_end), t(capture_prompt),
                         self._segments(starts, counts, first, captures, t), self)

    def carry(self, layer: int, s: StateStep, update) -> None:
        """Carry the step's sequences' states of recurrent layer `layer` through their rows, a
        segment at a time, sequences side by side: `update(rows, valid, states)` takes a
        round's rows [b, L] (`valid` [b, L] marks the segments' own; the others repeat a
        row and must leave the state as it is) and the states before them, and returns the
        states after them. The states at the block boundaries the step captures are copied
        for the snapshots."""
        pool = self.states[layer]
        state = pool.index_select(0, s.slots) * (~s.fresh).view(-1, *(1,) * (pool.dim() - 1))
        for seg in s.segments:
            state[seg.live] = after = update(seg.rows, seg.valid, state[seg.live])
            for which, copies, index in seg.captures:
                copies[layer].index_copy_(0, index, after[which])
        pool.index_copy_(0, s.slots, state)

    def _branch_captures(self, ids: list[int], first: np.ndarray, end: np.ndarray):
        """The rows after which sequences cross the point where they part from an earlier
        request (``hit``), and a copy of [layers, n, *shape] for those states."""
        at = np.array([self.branch_at.get(s, 0) for s in ids], dtype=np.int64)
        rows = np.where((first < at) & (at <= end), at - first - 1, -1)
        crossing = np.flatnonzero(rows >= 0)
        copies = torch.empty((self.layers, len(crossing), *self.states.shape[2:]), device=self.device) \
            if crossing.size else None
        for j, i in enumerate(crossing):
            self.branch_copies[ids[i]] = (int(at[i]), copies, j)
        index = np.zeros(len(ids), dtype=np.int64)
        index[crossing] = np.arange(len(crossing))
        return rows, copies, index

    def _draft_captures(self, plan, ids: list[int], first: np.ndarray, counts: np.ndarray):
        """For each sequence sampled at several rows (a token and its drafts), the state after
        each row but its last, kept until its next step (``drafted``), which starts from the one
        after the last token its drafts kept: one capture per row offset."""
        sampled = Counter(np.asarray(plan.sample_seq_ids).tolist())
        per_seq = np.array([sampled.get(s, 0) for s in ids], dtype=np.int64)
        out = []
        for r in range(int(per_seq.max(initial=0)) - 1):
            with_row = np.flatnonzero(per_seq > r + 1)
            rows = np.full(len(ids), -1, dtype=np.int64)
            rows[with_row] = counts[with_row] - per_seq[with_row] + r   # the sampled rows are the last ones
            copies = torch.empty((self.layers, len(with_row), *self.states.shape[2:]), device=self.device)
            index = np.zeros(len(ids), dtype=np.int64)
            index[with_row] = np.arange(len(with_row))
            for j, i in enumerate(with_row):
                self.drafted.setdefault(ids[i], {})[int(first[i] + rows[i] + 1)] = (copies, j)
            out.append((rows, copies, index))
        return out

    def _segments(self, starts, counts, first, captures, t) -> list[Segment]:
        """The step's rows as rounds of segments (Segment), cut at multiples of SCAN_CHUNK positions
        and after each row whose state is copied."""
        edges = []
        for i, (p, n) in enumerate(zip(first, counts)):
            cuts = [np.arange(SCAN_CHUNK - p % SCAN_CHUNK, n, SCAN_CHUNK), [0, n]]
            cuts += [[c[i] + 1] for c, _, _ in captures if c[i] >= 0]
            edges.append(np.unique(np.concatenate(cuts)))
        out = []
        for k in range(max(len(e) for e in edges) - 1):
            live = np.array([i for i, e in enumerate(edges) if len(e) - 1 > k], dtype=np.int64)
            lo = np.array([edges[i][k] for i in live], dtype=np.int64)
            hi = np.array([edges[i][k + 1] for i in live], dtype=np.int64)
            # one chunk shape per group of equal lengths: a row's numbers do not depend on the
            # other sequences in its step (a decoding row always takes the recurrence)
            for length in np.unique(hi - lo):
                same = np.flatnonzero(hi - lo == length)
                rows = (starts[live[same]] + lo[same])[:, None] + np.arange(length)[None]
                caps = []
                for capture, copies, index in captures:
                    hit = np.flatnonzero(capture[live[same]] == hi[same] - 1)
                    if hit.size:
                        caps.append((t(hit), copies, t(index[live[same][hit]])))
                out.append(Segment(t(live[same]), t(rows), t(np.ones(rows.shape, dtype=bool)), caps))
        return out

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
