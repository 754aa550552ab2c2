"""A minimal paged-cache driver for model-layer tests: a CausalLM run the way
the engine runs it (fixed-size blocks, a block table per sequence), and
transformers' greedy tokens to compare with."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from guided.model import AttentionMetadata, allocate_kv_cache
from guided.model.state_pool import StatePool


class PagedRunner:
    """Drives a CausalLM the way the engine does: fixed-size blocks, a block table per sequence."""

    def __init__(self, model, config, num_blocks=256, block_size=16):
        self.model, self.block_size = model, block_size
        self.caches = allocate_kv_cache(config, num_blocks, block_size, torch.float32, "cpu")
        self.free = list(range(1, num_blocks))  # block 0 is the padding target, never handed out
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        #: the Mamba layers' states, where the model has them (a slot per sequence, as the engine's runner)
        mixer = config.mamba or config.delta
        self.states = StatePool(config.state_shape, sum(map(config.is_recurrent, range(config.num_layers))), 8,
                                "cpu", block_size, mixer.conv_kernel) if mixer is not None else None

    def _reserve(self, seq: int, upto: int) -> None:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < upto:
            table.append(self.free.pop(0))

    def step(self, chunks: dict[int, list[int]]) -> torch.Tensor:
        """One forward over several sequences' new tokens; returns the hidden rows, in chunk order."""
        ids, pos, slots, starts, ctx = [], [], [], [0], []
        for seq, toks in chunks.items():
            start = self.lens.get(seq, 0)
            self._reserve(seq, start + len(toks))
            table = self.tables[seq]
            for p in range(start, start + len(toks)):
                slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
            ids += toks
            pos += range(start, start + len(toks))
            starts.append(len(ids))
            ctx.append(start + len(toks))
            self.lens[seq] = start + len(toks)
        width = max(len(self.tables[s]) for s in chunks)
        tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in chunks]
        qlens = [len(t) for t in chunks.values()]
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            context_lens=torch.tensor(ctx, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            max_query_len=max(qlens), max_context_len=max(ctx), block_size=self.block_size,
            is_decode_only=all(q == 1 for q in qlens))
        plan = SimpleNamespace(query_start_loc=np.array(starts), positions=np.array(pos),
                               seq_ids=np.array(list(chunks)), sample_seq_ids=np.array(list(chunks)),
                               block_tables=np.array(tables))
        states = self.states.step(plan) if self.states is not None else None
        return self.model(torch.tensor(ids), torch.tensor(pos), self.caches, attn, states)

    def greedy(self, prompt: list[int], n: int, chunk: int | None = None) -> list[int]:
        seq = len(self.tables) + 1000
        chunk = chunk or len(prompt)
        for i in range(0, len(prompt), chunk):
            hidden = self.step({seq: prompt[i:i + chunk]})
        out = []
        for _ in range(n):
            out.append(int(self.model.compute_logits(hidden[-1:]).argmax()))
            hidden = self.step({seq: [out[-1]]})
        return out

    def greedy_together(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """Greedy tokens of several prompts whose decode steps are shared."""
        first = len(self.tables) + 1000
        hidden = {first + i: self.step({first + i: p})[-1:] for i, p in enumerate(prompts)}
        outs = {s: [] for s in hidden}
        for _ in range(n):
            for s, h in hidden.items():
                outs[s].append(int(self.model.compute_logits(h).argmax()))
            step = self.step({s: [o[-1]] for s, o in outs.items()})
            hidden = {s: step[i:i + 1] for i, s in enumerate(outs)}
        return list(outs.values())


def last_logits(model, config, ids: list[int]) -> torch.Tensor:
    runner = PagedRunner(model, config)
    return model.compute_logits(runner.step({0: ids})[-1:])[0]


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None  # compare all n tokens, past any end token
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()
