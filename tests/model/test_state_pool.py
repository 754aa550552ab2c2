"""The pool of per-sequence recurrent states (model/mamba.py's StatePool): a
sequence holds one slot from its first step to its end; a step that does not
start where the sequence's state is fails by name instead of reading another
position's state; a preempted sequence recomputing from position 0 starts
from zeros; slots come back and the pool grows only while all are held."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from guided.model.layer_kinds import MambaConfig
from guided.model.mamba import StatePool

MAMBA = MambaConfig(heads=2, head_dim=4, state_size=3, groups=1, conv_kernel=4)


def plan(*rows: tuple[int, int, int]):
    """Sequences as (seq id, first position, rows)."""
    starts = np.cumsum([0] + [n for _, _, n in rows])
    positions = np.concatenate([np.arange(p, p + n) for _, p, n in rows])
    return SimpleNamespace(query_start_loc=starts, positions=positions, seq_ids=np.array([s for s, _, _ in rows]))


def test_a_sequence_keeps_its_slot_and_its_position_is_checked():
    pool = StatePool(MAMBA, layers=3, slots=2, device="cpu")
    assert pool.bytes_per_sequence == 3 * 2 * 4 * 3 * 4
    first = pool.step(plan((7, 0, 5), (9, 0, 2)))
    assert first.fresh.tolist() == [True, True] and first.counts.tolist() == [5, 2]
    again = pool.step(plan((9, 2, 1), (7, 5, 1)))
    assert again.slots.tolist() == first.slots.flip(0).tolist() and not again.fresh.any()
    with pytest.raises(RuntimeError, match="sequence 7's recurrent state is at position 6, its step starts at 4"):
        pool.step(plan((7, 4, 1)))


def test_recomputing_from_zero_starts_fresh_and_slots_come_back():
    pool = StatePool(MAMBA, layers=1, slots=1, device="cpu")
    step = pool.step(plan((3, 0, 4)))
    assert step.fresh.all()
    assert pool.step(plan((3, 0, 6))).fresh.all(), "preempted: recomputed from position 0"
    held = pool.step(plan((4, 0, 1)))   # sequence 3 still holds the only slot: one more
    assert pool.states.shape[1] == 2 and held.slots.tolist() == [1]
    pool.release(3)
    pool.release(4)
    assert sorted(pool.free) == [0, 1] and not pool.slot_of
