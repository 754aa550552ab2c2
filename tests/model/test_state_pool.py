"""The pool of per-sequence recurrent states (model/state_pool.py): a sequence
holds one slot from its first step to its end; a step that does not start
where the sequence's state is (or where a promised snapshot puts it) fails by
name instead of reading another position's state; a preempted sequence
recomputing from position 0 starts from zeros; slots come back; the states
at block boundaries are kept as snapshots when a sequence ends, and a later
prompt is promised the longest one it extends."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from guided.model.state_pool import StatePool

SHAPE = (2, 4, 3)   # a layer's state of one sequence: Mamba-2's [heads, head_dim, state_size]


def plan(*rows: tuple[int, int, int]):
    """Sequences as (seq id, first position, rows)."""
    starts = np.cumsum([0] + [n for _, _, n in rows])
    positions = np.concatenate([np.arange(p, p + n) for _, p, n in rows])
    return SimpleNamespace(query_start_loc=starts, positions=positions, seq_ids=np.array([s for s, _, _ in rows]))


def test_a_sequence_keeps_its_slot_and_its_position_is_checked():
    pool = StatePool(SHAPE, layers=3, slots=2, device="cpu", block_size=4)
    assert pool.bytes_per_sequence == 3 * 2 * 4 * 3 * 4
    first = pool.step(plan((7, 0, 5), (9, 0, 2)))
    assert first.fresh.tolist() == [True, True] and first.counts.tolist() == [5, 2]
    again = pool.step(plan((9, 2, 1), (7, 5, 1)))
    assert again.slots.tolist() == first.slots.flip(0).tolist() and not again.fresh.any()
    with pytest.raises(RuntimeError, match="sequence 7's recurrent state is at position 6, its step starts at 4"):
        pool.step(plan((7, 4, 1)))


def test_recomputing_from_zero_starts_fresh_and_slots_come_back():
    pool = StatePool(SHAPE, layers=1, slots=1, device="cpu", block_size=4)
    assert pool.step(plan((3, 0, 4))).fresh.all()
    assert pool.step(plan((3, 0, 6))).fresh.all(), "preempted: recomputed from position 0"
    held = pool.step(plan((4, 0, 1)))   # sequence 3 still holds the only slot: one more
    assert pool.states.shape[1] == 2 and held.slots.tolist() == [1]
    pool.release(3)
    pool.release(4)
    assert sorted(pool.free) == [0, 1] and not pool.slot_of


def test_boundary_states_become_snapshots_a_later_prompt_starts_from():
    pool = StatePool(SHAPE, layers=1, slots=2, device="cpu", block_size=4)
    prompt = list(range(10, 20))                        # 10 tokens: its last boundary before its end is 8
    assert pool.hit(1, prompt) == 0
    step = pool.step(plan((1, 0, 10)))
    assert step.capture_end.tolist() == [7] and step.capture_prompt.tolist() == [7]   # after position 7
    pool.at_end[:, 0], pool.at_prompt[:, 0] = 1.0, 2.0  # what the scan would copy there
    step = pool.step(plan((1, 10, 1)))
    assert step.capture_end.tolist() == [-1]           # positions 10..10: no boundary crossed
    step = pool.step(plan((1, 11, 2)))
    assert step.capture_end.tolist() == [0]            # position 11 ends block 3: boundary 12
    pool.at_end[:, 0] = 3.0
    answer = [7, 8, 9, 5]
    pool.release(1, prompt + answer)
    # the next turn extends prompt and answer: promised the boundary at 12, its first step restored
    assert pool.hit(2, prompt + answer[:3] + [6, 6, 6, 6]) == 12
    step = pool.step(plan((2, 12, 4)))
    assert not step.fresh.any() and torch.all(pool.states[:, step.slots[0]] == 3.0)
    # the same prompt again: the boundary before its last token, 8, from the prompt's copy
    assert pool.hit(3, prompt) == 8
    pool.step(plan((3, 8, 2)))
    assert torch.all(pool.states[:, pool.slot_of[3]] == 2.0)
    with pytest.raises(RuntimeError, match="at position -1, its step starts at 4"):
        pool.step(plan((4, 4, 1)))                     # a start nobody promised
    pool.release(4)
    pool.release(2)                                    # a slot that reached 16 ...
    with pytest.raises(RuntimeError, match="at position -1, its step starts at 16"):
        pool.step(plan((5, 16, 1)))                    # ... is no state for its next owner at 16
