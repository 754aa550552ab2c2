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
from hypothesis import given, settings
from hypothesis import strategies as st

from guided.model.delta_net import DeltaNet
from guided.model.layer_kinds import DeltaNetConfig, MambaConfig
from guided.model.mamba import Mamba2
from guided.model.state_pool import StatePool

SHAPE = (2, 4, 3)   # a layer's state of one sequence: Mamba-2's [heads, head_dim, state_size]


def plan(*rows: tuple[int, int, int]):
    """Sequences as (seq id, first position, rows)."""
    starts = np.cumsum([0] + [n for _, _, n in rows])
    positions = np.concatenate([np.arange(p, p + n) for _, p, n in rows])
    return SimpleNamespace(query_start_loc=starts, positions=positions, seq_ids=np.array([s for s, _, _ in rows]),
                           sample_seq_ids=np.array([s for s, _, _ in rows]))


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


# -- the chunked scans against the recurrence, token by token ---------------------------------

def _random_parameters(module: torch.nn.Module, gen: torch.Generator) -> None:
    for name, p in list(module.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        target = module.get_submodule(owner) if owner else module
        setattr(target, leaf, torch.nn.Parameter(torch.randn(p.shape, generator=gen) * 0.5, requires_grad=False))


def _mamba_reference(mixer, x, dt, b, c, state):
    """Mamba-2's recurrence over one sequence's rows, a token at a time: outputs and final state."""
    m = mixer.m
    b = b.unflatten(-1, (m.groups, m.state_size)).repeat_interleave(m.heads // m.groups, dim=1)
    c = c.unflatten(-1, (m.groups, m.state_size)).repeat_interleave(m.heads // m.groups, dim=1)
    a = -torch.exp(mixer.A_log)
    ys, states = [], []
    for t in range(x.shape[0]):
        state = state * torch.exp(dt[t] * a)[:, None, None] + (dt[t][:, None] * x[t])[..., None] * b[t][:, None]
        ys.append(state @ c[t][..., None])
        ys[-1] = ys[-1].squeeze(-1) + mixer.D[:, None] * x[t]
        states.append(state)
    return torch.stack(ys), states


def _delta_reference(q, k, v, beta, g, state):
    """The gated delta rule over one sequence's rows, a token at a time."""
    os_, states = [], []
    for t in range(q.shape[0]):
        state = state * torch.exp(g[t])[:, None, None]
        delta = (v[t] - (state * k[t][..., None]).sum(-2)) * beta[t][:, None]
        state = state + k[t][..., None] * delta[:, None, :]
        os_.append((state * q[t][..., None]).sum(-2))
        states.append(state)
    return torch.stack(os_), states


@settings(max_examples=40, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40), st.booleans()), min_size=1, max_size=5),
       block=st.sampled_from([4, 16]), kind=st.sampled_from(["mamba", "delta"]), seed=st.integers(0, 2**16))
def test_the_chunked_scans_equal_the_recurrence_token_by_token(seqs, block, kind, seed):
    """A step of sequences at any positions and lengths (some starting fresh, others from a
    state), cut into segments at block boundaries and scanned in the chunked forms: every row's
    output, each sequence's final state and its copy at the last block boundary it crossed
    equal the recurrence run token by token, within float32 rounding."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "mamba":
        mixer = Mamba2(MambaConfig(heads=4, head_dim=3, state_size=5, groups=2, conv_kernel=4), 0, 1e-5)
        shape = (4, 3, 5)
    else:
        mixer = DeltaNet(DeltaNetConfig(k_heads=2, v_heads=4, k_dim=5, v_dim=3, conv_kernel=4), 0, 1e-5)
        shape = (4, 5, 3)
    _random_parameters(mixer, gen)
    pool = StatePool(shape, layers=1, slots=len(seqs), device="cpu", block_size=block)
    # each sequence first steps to its start position (or not, starting at 0), then the step under test
    rows = [(i, first if keep else 0, n) for i, (first, n, keep) in enumerate(seqs)]
    before = {}
    for i, first, _ in rows:
        if first:
            pool.step(plan((i, 0, first)))
            before[i] = pool.states[0, pool.slot_of[i]] = torch.randn(shape, generator=gen)
    step = pool.step(plan(*rows))
    total = sum(n for _, _, n in rows)
    f = lambda *s: torch.randn(total, *s, generator=gen)  # noqa: E731
    if kind == "mamba":
        x, dt, b, c = f(4, 3), torch.rand(total, 4, generator=gen) * 2, f(10), f(10)
        out = mixer._scan(x, dt, b, c, step)
    else:
        q, k = (torch.nn.functional.normalize(f(4, 5), dim=-1) for _ in range(2))
        v, beta, g = f(4, 3), torch.rand(total, 4, generator=gen), -torch.rand(total, 4, generator=gen) * 2
        out = mixer._scan(q, k, v, beta, g, step)
    for (i, first, n), start in zip(rows, step.starts.tolist()):
        state = before.get(i, torch.zeros(shape))
        part = slice(start, start + n)
        want, states = _mamba_reference(mixer, x[part], dt[part], b[part], c[part], state) if kind == "mamba" \
            else _delta_reference(q[part], k[part], v[part], beta[part], g[part], state)
        slot = pool.slot_of[i]
        torch.testing.assert_close(out[part], want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool.states[0, slot], states[-1], rtol=1e-4, atol=1e-4)
        if (row := int(step.capture_end[step.slots.tolist().index(slot)])) >= 0:
            torch.testing.assert_close(pool.at_end[0, slot], states[row], rtol=1e-4, atol=1e-4)


def test_where_a_prompt_parts_from_an_earlier_one_its_state_is_kept_for_the_next():
    """Three prompts share 8 tokens (a system prompt) and then differ: the first keeps its own
    boundaries only; the second finds no snapshot but sees where it parts from the first, and
    its state there is copied; the third starts from that copy."""
    pool = StatePool(SHAPE, layers=1, slots=3, device="cpu", block_size=4)
    system = list(range(100, 108))
    prompts = [system + [i] * 6 for i in (1, 2, 3)]     # 14 tokens: the prompt's own boundary is 12
    assert pool.hit(1, prompts[0]) == 0 and 1 not in pool.branch_at
    pool.step(plan((1, 0, 14)))
    pool.release(1, prompts[0] + [9])
    assert pool.hit(2, prompts[1]) == 0 and pool.branch_at[2] == 8
    step = pool.step(plan((2, 0, 14)))
    assert len([c for seg in step.segments for c in seg.captures if c[1] is pool.branch_copies[2][1]]) == 1
    assert pool.branch_copies[2][0] == 8
    pool.branch_copies[2][1][:] = 5.0                   # what the scan would copy after position 7
    pool.release(2, prompts[1] + [9])
    assert pool.hit(3, prompts[2]) == 8 and 3 not in pool.branch_at
    pool.step(plan((3, 8, 6)))
    assert torch.all(pool.states[:, pool.slot_of[3]] == 5.0)
    # a prompt going on past its snapshot along the third's tokens marks where it parts from them
    assert pool.hit(4, prompts[2][:12] + [7] * 8) == 8 and pool.branch_at[4] == 12


def test_refused_drafts_roll_the_state_back_to_the_last_token_kept():
    """A verify step runs a token and two drafts; the next step starts after the token alone (both
    drafts refused), or after the first draft: its state is the recurrence's over the tokens kept,
    not over the refused ones; a copy at a boundary past the kept tokens is dropped."""
    gen = torch.Generator().manual_seed(0)
    mixer = Mamba2(MambaConfig(heads=4, head_dim=3, state_size=5, groups=2, conv_kernel=4), 0, 1e-5)
    _random_parameters(mixer, gen)
    rand = lambda n: (torch.randn(n, 4, 3, generator=gen), torch.rand(n, 4, generator=gen),  # noqa: E731
                      torch.randn(n, 10, generator=gen), torch.randn(n, 10, generator=gen))
    for kept in (0, 1):
        pool = StatePool((4, 3, 5), layers=1, slots=1, device="cpu", block_size=4)
        x, dt, b, c = rand(9)
        mixer._scan(x[:6], dt[:6], b[:6], c[:6], pool.step(plan((1, 0, 6))))
        verify = plan((1, 6, 3))
        verify.sample_seq_ids = np.array([1, 1, 1])         # the token and its two drafts sampled
        step = pool.step(verify)
        assert step.capture_end.tolist() == [1]              # position 7 ends block 1: boundary 8
        mixer._scan(x[6:9], dt[6:9], b[6:9], c[6:9], step)
        nxt = pool.step(plan((1, 7 + kept, 1)))              # the next token after the last one kept
        _, states = _mamba_reference(mixer, x[:7 + kept], dt[:7 + kept], b[:7 + kept], c[:7 + kept],
                                     torch.zeros(4, 3, 5))
        torch.testing.assert_close(pool.states[0, 0], states[-1], rtol=1e-5, atol=1e-5)
        # the copy at boundary 8: with the first draft kept, the verify step's; without it, the
        # next step's over the token written instead (never the refused draft's)
        y = rand(1)
        mixer._scan(*y, nxt)
        tokens = [torch.cat([t[:7 + kept], n]) for t, n in zip((x, dt, b, c), y)]
        _, states = _mamba_reference(mixer, *tokens, torch.zeros(4, 3, 5))
        assert pool.end_at[0] == 8
        torch.testing.assert_close(pool.at_end[0, 0], states[7], rtol=1e-5, atol=1e-5)
    # a copy made past the tokens kept, which the next step does not reach again, is dropped
    pool = StatePool((4, 3, 5), layers=1, slots=1, device="cpu", block_size=4)
    pool.step(plan((1, 0, 5)))
    verify = plan((1, 5, 4))
    verify.sample_seq_ids = np.array([1, 1, 1, 1])
    assert pool.step(verify).capture_end.tolist() == [2]    # after position 7: boundary 8
    pool.step(plan((1, 6, 1)))                               # the token at 5 kept, none of its drafts
    assert pool.end_at[0] == 0
