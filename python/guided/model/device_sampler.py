"""Sampling where the logits are: one step's rows drawn by the mask-fused
kernels of ``cuda/sampling.cu`` on the device that ran the forward pass.

The scheduler hands over each sampling row as the kernels read it
(``Scheduler.device_rows``, rust/cuda/device_sampling.rs): the grammar masks
packed over the whole vocabulary, temperature/top-k/top-p/min-p, the seed
and step of the sequence's own random stream (the stream the CPU sampler
draws from, so a seed gives the same tokens on both), and one entry per
(row, token) for penalties, logit bias and min_tokens bans. Then two
launches: the adjustments in place, and the masked draw. Only the tokens
and their log-probabilities cross back to the host; the logits never do.

Rows that ask for top logprobs keep the host path: their logits rows are
copied over before the adjustments and the CPU sampler draws them (it
sorts the alternatives).

``backend="reference"`` runs the same two passes on the CPU
(rust/cuda/reference.rs): the kernels' stand-in where there is no GPU, so
the engine step with device sampling is tested on every machine.
"""
from __future__ import annotations

import numpy as np
import torch

from .. import _native
from . import cuda_ops


class DeviceSampler:
    def __init__(self, backend: str = "cuda"):
        if backend not in ("cuda", "reference"):
            raise ValueError(f"backend must be 'cuda' or 'reference', got {backend!r}")
        self.backend = backend
        self._pinned: torch.Tensor | None = None  # the mask's staging buffer (cuda)

    def sample(self, scheduler: _native.Scheduler, logits: torch.Tensor):
        """(tokens int64 [R], logprobs float32 [R], tops) for the last plan's
        rows, as ``Scheduler.sample`` returns them; ``logits`` [R, V] float32
        on the device, overwritten."""
        rows = scheduler.device_rows(int(logits.shape[-1]))
        host = np.flatnonzero(rows.host)
        # the host's rows leave before the adjustments change them
        host_logits = logits[torch.from_numpy(host).to(logits.device)].cpu().numpy() if host.size else None
        if self.backend == "cuda":
            tokens, logprobs = self._on_device(logits, rows)
        else:
            tokens, logprobs = self._on_cpu(logits, rows)
        tops: list = [None] * len(tokens)
        if host_logits is not None:
            t, lp, top = scheduler.sample_host(host_logits, host.tolist())
            tokens[host], logprobs[host] = t, lp
            for i, row in enumerate(host):
                tops[row] = top[i]
        return tokens, logprobs, tops

    def _on_device(self, logits: torch.Tensor, rows) -> tuple[np.ndarray, np.ndarray]:
        mask = None
        if rows.mask is not None:
            mask = self._staged(rows.mask).to(logits.device, non_blocking=True)
        if len(rows.entry_rows):
            cuda_ops.adjust_logits(logits, rows.entry_rows, rows.entry_tokens, rows.entry_seen,
                                   rows.entry_counts, rows.entry_bias, rows.repetition,
                                   rows.frequency, rows.presence)
        tokens, logprobs = cuda_ops.masked_sample(logits, mask, rows.temperature, rows.top_k, rows.top_p,
                                                  rows.min_p, rows.seeds, rows.steps)
        return tokens.cpu().numpy(), logprobs.cpu().numpy()

    def _staged(self, mask: np.ndarray) -> torch.Tensor:
        """``mask`` in pinned host memory (one buffer, grown as needed), so
        its copy to the device is asynchronous. The previous step's copy is
        done by now: its tokens were read back after it."""
        n = mask.size
        if self._pinned is None or self._pinned.numel() < n:
            self._pinned = torch.empty(max(n, 1 << 16), dtype=torch.int32, pin_memory=True)
        staged = self._pinned[:n].view(mask.shape)
        staged.numpy()[...] = mask
        return staged

    @staticmethod
    def _on_cpu(logits: torch.Tensor, rows) -> tuple[np.ndarray, np.ndarray]:
        x = np.ascontiguousarray(logits.detach().cpu().numpy(), dtype=np.float32)
        _native.reference_adjust_logits(x, rows.entry_rows, rows.entry_tokens, rows.entry_seen,
                                        rows.entry_counts, rows.entry_bias, rows.repetition,
                                        rows.frequency, rows.presence)
        return _native.reference_masked_sample(x, rows.mask, rows.temperature, rows.top_k, rows.top_p,
                                               rows.min_p, rows.seeds, rows.steps)
