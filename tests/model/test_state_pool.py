"""The pool of per-sequence recurrent states (model/state_pool.py): a sequence
holds one slot from its first step to its end; a step that does not start in
the block its state opens (or where a promised snapshot puts it) fails by name
instead of reading another position's state; a preempted sequence recomputing
from position 0 starts from zeros; slots come back; the states at block
boundaries are kept as snapshots when a sequence ends, and a later prompt is
promised the longest one it extends; the mixers' blocks, computed whole from
the paged cache, equal the recurrence run token by token however the rows
come, and refused drafts roll back."""
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
TABLE = 16          # blocks per sequence in the plans below (sequence s owns blocks s·16 ...)


def plan(*rows: tuple[int, int, int], sampled: dict[int, int] | None = None):
    """Sequences as (seq id, first position, rows); `sampled`: rows sampled per sequence (1)."""
    starts = np.cumsum([0] + [n for _, _, n in rows])
    positions = np.concatenate([np.arange(p, p + n) for _, p, n in rows])
    ids = [s for s, _, _ in rows]
    return SimpleNamespace(query_start_loc=starts, positions=positions, seq_ids=np.array(ids),
                           sample_seq_ids=np.array([s for s in ids for _ in range((sampled or {}).get(s, 1))]),
                           block_tables=np.array([np.arange(TABLE) + s * TABLE for s in ids]))


def counting(pool: StatePool, step) -> None:
    """Carry the step as a scan would, with states that count the blocks made whole."""
    pool.carry(0, step, lambda seg, st: st + 1)


def test_a_sequence_keeps_its_slot_and_its_position_is_checked():
    pool = StatePool(SHAPE, layers=3, slots=2, device="cpu", block_size=4)
    assert pool.bytes_per_sequence == 3 * 2 * 4 * 3 * 4
    first = pool.step(plan((7, 0, 5), (9, 0, 2)))
    assert first.fresh.tolist() == [True, True] and first.rows == 7
    again = pool.step(plan((9, 2, 1), (7, 5, 1)))
    assert again.slots.tolist() == first.slots.flip(0).tolist() and not again.fresh.any()
    pool.step(plan((7, 4, 1)))   # back within the block its state opens (position 4's): recomputed
    with pytest.raises(RuntimeError, match="sequence 7's recurrent state is at position 5, its step starts at 1"):
        pool.step(plan((7, 1, 1)))


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
    counting(pool, pool.step(plan((1, 0, 10))))         # blocks [0, 4) and [4, 8) whole: 2
    assert torch.all(pool.states[:, 0] == 2) and torch.all(pool.at_prompt[:, 0] == 2) and pool.prompt_at[0] == 8
    counting(pool, pool.step(plan((1, 10, 1))))         # within [8, 12): no boundary passed
    assert torch.all(pool.states[:, 0] == 2)
    counting(pool, pool.step(plan((1, 11, 2))))         # position 11 ends [8, 12): the state at 12
    assert torch.all(pool.states[:, 0] == 3)
    answer = [7, 8, 9, 5]
    pool.release(1, prompt + answer)
    # the next turn extends prompt and answer: promised the boundary at 12, its first step restored
    assert pool.hit(2, prompt + answer[:3] + [6, 6, 6, 6]) == 12
    step = pool.step(plan((2, 12, 4)))
    assert not step.fresh.any() and torch.all(pool.states[:, step.slots[0]] == 3)
    # the same prompt again: the boundary before its last token, 8, from the prompt's copy
    assert pool.hit(3, prompt) == 8
    pool.step(plan((3, 8, 2)))
    assert torch.all(pool.states[:, pool.slot_of[3]] == 2)
    with pytest.raises(RuntimeError, match="at position -1, its step starts at 4"):
        pool.step(plan((4, 4, 1)))                     # a start nobody promised
    pool.release(4)
    pool.release(2)                                    # a slot that reached 16 ...
    with pytest.raises(RuntimeError, match="at position -1, its step starts at 16"):
        pool.step(plan((5, 16, 1)))                    # ... is no state for its next owner at 16


def test_where_a_prompt_parts_from_an_earlier_one_its_state_is_kept_for_the_next():
    """Three prompts share 8 tokens (a system prompt) and then differ: the first keeps its own
    boundaries only; the second finds no snapshot but sees where it parts from the first, and
    its state there is copied; the third starts from that copy."""
    pool = StatePool(SHAPE, layers=1, slots=3, device="cpu", block_size=4)
    system = list(range(100, 108))
    prompts = [system + [i] * 6 for i in (1, 2, 3)]     # 14 tokens: the prompt's own boundary is 12
    assert pool.hit(1, prompts[0]) == 0 and 1 not in pool.branch_at
    counting(pool, pool.step(plan((1, 0, 14))))
    pool.release(1, prompts[0] + [9])
    assert pool.hit(2, prompts[1]) == 0 and pool.branch_at[2] == 8
    counting(pool, pool.step(plan((2, 0, 14))))
    at, copies, j = pool.branch_copies[2]
    assert at == 8 and torch.all(copies[:, j] == 2)     # the state at 8: two blocks whole
    copies[:, j] = 5.0                                  # marked, to be seen below
    pool.release(2, prompts[1] + [9])
    assert pool.hit(3, prompts[2]) == 8 and 3 not in pool.branch_at
    pool.step(plan((3, 8, 6)))
    assert torch.all(pool.states[:, pool.slot_of[3]] == 5.0)
    # a prompt going on past its snapshot along the third's tokens marks where it parts from them
    assert pool.hit(4, prompts[2][:12] + [7] * 8) == 8 and pool.branch_at[4] == 12


# -- the mixers' blocks against the recurrence, token by token --------------------------------

def _random_parameters(module: torch.nn.Module, gen: torch.Generator) -> None:
    for name, p in list(module.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        target = module.get_submodule(owner) if owner else module
        setattr(target, leaf, torch.nn.Parameter(torch.randn(p.shape, generator=gen) * 0.5, requires_grad=False))


def _conv(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The causal depthwise convolution of [T, C] inputs (zeros before the first)."""
    padded = torch.cat([torch.zeros(weight.shape[1] - 1, inputs.shape[1]), inputs])
    return torch.stack([(padded[t:t + weight.shape[1]].T * weight).sum(-1) for t in range(len(inputs))])


def _mamba_reference(mixer: Mamba2, projected: torch.Tensor):
    """Mamba-2's y [T, H, P] and states after each token, a token at a time from zeros."""
    m = mixer.m
    _, xbc, dt = projected.split([m.inner, m.conv_dim, m.heads], dim=-1)
    x, b, c = torch.nn.functional.silu(_conv(xbc, mixer.conv.weight) + mixer.conv.bias).split(
        [m.inner, m.groups * m.state_size, m.groups * m.state_size], dim=-1)
    dt = torch.nn.functional.softplus(dt + mixer.dt_bias)
    x = x.unflatten(-1, (m.heads, m.head_dim))
    b, c = (v.unflatten(-1, (m.groups, m.state_size)).repeat_interleave(m.heads // m.groups, dim=1) for v in (b, c))
    state, ys, states = torch.zeros(m.heads, m.head_dim, m.state_size), [], []
    for t in range(len(x)):
        state = state * torch.exp(dt[t] * -torch.exp(mixer.A_log))[:, None, None] \
            + (dt[t][:, None] * x[t])[..., None] * b[t][:, None]
        ys.append((state @ c[t][..., None]).squeeze(-1) + mixer.D[:, None] * x[t])
        states.append(state)
    return torch.stack(ys), states


def _delta_reference(mixer: DeltaNet, projected: torch.Tensor):
    """The gated delta rule's o [T, H, V] and states after each token, a token at a time."""
    d = mixer.d
    qkv, _, b, a = projected.split([d.conv_dim, d.value_dim, d.v_heads, d.v_heads], dim=-1)
    q, k, v = torch.nn.functional.silu(_conv(qkv, mixer.conv.weight)).split([d.key_dim, d.key_dim, d.value_dim], -1)
    group = d.v_heads // d.k_heads
    q, k = (torch.nn.functional.normalize(x.view(len(x), d.k_heads, d.k_dim), dim=-1, eps=1e-6)
            .repeat_interleave(group, dim=1) for x in (q, k))
    q, v = q * d.k_dim ** -0.5, v.view(len(v), d.v_heads, d.v_dim)
    beta = torch.sigmoid(b)
    g = -torch.exp(mixer.A_log) * torch.nn.functional.softplus(a + mixer.dt_bias)
    state, outs, states = torch.zeros(d.v_heads, d.k_dim, d.v_dim), [], []
    for t in range(len(q)):
        state = state * torch.exp(g[t])[:, None, None]
        delta = (v[t] - (state * k[t][..., None]).sum(-2)) * beta[t][:, None]
        state = state + k[t][..., None] * delta[:, None, :]
        outs.append((state * q[t][..., None]).sum(-2))
        states.append(state)
    return torch.stack(outs), states


def _mixer(kind: str, gen: torch.Generator):
    if kind == "mamba":
        mixer = Mamba2(MambaConfig(heads=4, head_dim=3, state_size=5, groups=2, conv_kernel=4), 0, 1e-5)
        width, cache, shape = mixer.m.inner + mixer.m.conv_dim + mixer.m.heads, mixer.m.cache_width, (4, 3, 5)
    else:
        mixer = DeltaNet(DeltaNetConfig(k_heads=2, v_heads=4, k_dim=5, v_dim=3, conv_kernel=4), 0, 1e-5)
        width, cache, shape = mixer.d.conv_dim + mixer.d.value_dim + 2 * mixer.d.v_heads, mixer.d.cache_width, (4, 5, 3)
    _random_parameters(mixer, gen)
    return mixer, width, cache, shape


def _run(mixer, kind, pool, cache, projected: dict[int, torch.Tensor], rows, sampled=None):
    """One step of `rows` (seq id, first, count) through the mixer's scan: each sequence's
    outputs [count, H, D] (the cache written as the mixer's forward writes it)."""
    step_plan = plan(*rows, sampled=sampled)
    step = pool.step(step_plan)
    block = pool.block_size
    part = [projected[s][first:first + n] for s, first, n in rows]
    slots = torch.tensor([(s * TABLE + p // block) * block + p % block for s, first, n in rows
                          for p in range(first, first + n)])
    flat = cache.view(-1, cache.shape[-1])
    joined = torch.cat(part)
    if kind == "mamba":
        m = mixer.m
        _, xbc, dt = joined.split([m.inner, m.conv_dim, m.heads], dim=-1)
        flat.index_copy_(0, slots, torch.cat([xbc, dt], dim=-1))
    else:
        d = mixer.d
        qkv, _, b, a = joined.split([d.conv_dim, d.value_dim, d.v_heads, d.v_heads], dim=-1)
        flat.index_copy_(0, slots, torch.cat([qkv, b, a], dim=-1))
    out = mixer._scan(flat, step)
    return dict(zip([s for s, _, _ in rows], out.split([n for _, _, n in rows])))


@settings(max_examples=40, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=4),
       block=st.sampled_from([4, 16]), kind=st.sampled_from(["mamba", "delta"]), seed=st.integers(0, 2**16))
def test_the_blocks_equal_the_recurrence_token_by_token_however_the_rows_come(seqs, block, kind, seed):
    """Sequences of any lengths, each cut at any point into two steps (the second step's rows
    with the others', the first's alone): every row's output and the state each slot keeps (at
    the last block boundary passed) equal the recurrence run token by token, within float32
    rounding; and a sequence alone gives the same numbers to the bit wherever its rows are cut
    into steps (batched with others, torch's elementwise kernels may round an element otherwise
    by where it falls in a vector: within rounding then)."""
    gen = torch.Generator().manual_seed(seed)
    mixer, width, cache_width, shape = _mixer(kind, gen)
    projected = {s: torch.randn(n, width, generator=gen) for s, (n, _) in enumerate(seqs)}
    runs = []
    for split in (True, False):
        pool = StatePool(shape, layers=1, slots=len(seqs), device="cpu", block_size=block, conv_kernel=4)
        cache = torch.zeros(len(seqs) * TABLE, block, 1, cache_width)
        outs: dict[int, list[torch.Tensor]] = {s: [] for s in projected}
        cuts = {s: min(cut, n - 1) if split else 0 for s, (n, cut) in enumerate(seqs)}
        for s, cut in cuts.items():
            if cut:
                outs[s].append(_run(mixer, kind, pool, cache, projected, [(s, 0, cut)])[s])
        got = _run(mixer, kind, pool, cache, projected, [(s, cuts[s], len(projected[s]) - cuts[s]) for s in projected])
        for s in projected:
            outs[s].append(got[s])
        runs.append({s: torch.cat(o) for s, o in outs.items()})
        for s, p in projected.items():
            want, states = (_mamba_reference if kind == "mamba" else _delta_reference)(mixer, p)
            torch.testing.assert_close(runs[-1][s], want, rtol=1e-4, atol=1e-4)
            boundary = len(p) // block * block
            kept = states[boundary - 1] if boundary else torch.zeros(shape)
            torch.testing.assert_close(pool.states[0, pool.slot_of[s]], kept, rtol=1e-4, atol=1e-4)
    if len(seqs) == 1:
        assert torch.equal(runs[0][0], runs[1][0]), "a row's numbers depend on the steps it came in"


def test_refused_drafts_roll_the_state_back_to_the_last_token_kept():
    """A verify step runs a token and three drafts past a block boundary; the next step starts
    after the token alone or after the first draft: every output and kept state equal the
    recurrence's over the tokens kept (the refused ones overwritten), not over the refused ones."""
    gen = torch.Generator().manual_seed(0)
    for kept in (0, 1, 2):
        mixer, width, cache_width, shape = _mixer("mamba", gen)
        pool = StatePool(shape, layers=1, slots=1, device="cpu", block_size=4, conv_kernel=4)
        cache = torch.zeros(TABLE, 4, 1, cache_width)
        refused = torch.randn(10, width, generator=gen)
        _run(mixer, "mamba", pool, cache, {0: refused}, [(0, 0, 6)])
        _run(mixer, "mamba", pool, cache, {0: refused}, [(0, 6, 4)], sampled={0: 4})   # passes 8
        truth = torch.cat([refused[:7 + kept], torch.randn(3, width, generator=gen)])   # other tokens after
        out = _run(mixer, "mamba", pool, cache, {0: truth}, [(0, 7 + kept, 3)])[0]
        want, states = _mamba_reference(mixer, truth)
        torch.testing.assert_close(out, want[7 + kept:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool.states[0, 0], states[len(truth) // 4 * 4 - 1], rtol=1e-4, atol=1e-4)
